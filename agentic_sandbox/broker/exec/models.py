"""The exec API's request and answer models (`POST /api/v2/admin/instances/{id}/exec`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from agentic_sandbox.broker.http.schemas import EnvName, Input, Output, nul_free_values
from agentic_sandbox.broker.sessions import BudgetIn, BudgetOut

Arg = Annotated[str, StringConstraints(max_length=32768)]
Reason = Literal["timeout", "memory", "pids", "output-limit", "canceled"]


class ExecRequest(Input):
    argv: list[Arg] = Field(
        min_length=1,
        max_length=4096,
        description="the program and its arguments, run as is (a shell only when you name "
        'one: ["bash", "-lc", "…"])',
    )
    env: dict[EnvName, Annotated[str, StringConstraints(max_length=32768)]] = Field(
        default_factory=dict, max_length=256
    )
    cwd: str | None = Field(
        default=None, pattern=r"^/[^\x00]*$", max_length=4096, description="absolute path"
    )
    user: str | None = Field(default=None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    stdin: str | None = Field(default=None, description="text written to stdin (UTF-8)")
    stdin_base64: str | None = Field(default=None, description="bytes written to stdin")
    budget: BudgetIn = BudgetIn()
    stdout_limit_bytes: int | None = Field(
        default=None, ge=0, description="stdout kept in the answer (the rest is counted)"
    )
    stderr_limit_bytes: int | None = Field(default=None, ge=0)
    output_encoding: Literal["text", "base64"] = Field(
        default="text", description="text: UTF-8 (invalid bytes replaced); base64: exact bytes"
    )

    @field_validator("argv")
    @classmethod
    def _program(cls, value: list[str]) -> list[str]:
        if not value[0]:
            raise ValueError("argv[0] must name a program")
        if any("\x00" in a for a in value):
            raise ValueError("arguments cannot contain NUL bytes")
        return value

    @field_validator("env")
    @classmethod
    def _no_nul_env(cls, value: dict[str, str]) -> dict[str, str]:
        return nul_free_values(value)

    @model_validator(mode="after")
    def _one_stdin(self) -> ExecRequest:
        if self.stdin is not None and self.stdin_base64 is not None:
            raise ValueError("give stdin or stdin_base64, not both")
        return self


class StreamOut(Output):
    data: str = Field(description="what was kept, in `encoding`")
    bytes: int = Field(description="bytes the command wrote to this stream, kept or not")
    truncated: bool = Field(description="more was written than kept (see *_limit_bytes)")


class UsageOut(Output):
    cpu_seconds: float
    peak_memory_bytes: int
    output_bytes: int = Field(description="stdout + stderr bytes the command wrote")
    network_egress_bytes: int = Field(
        default=0,
        description="bytes its egress proxy connections sent (the ones that named its proxy "
        "URL's token, as every tool it starts does by default; 0 without an allowlist)",
    )
    network_ingress_bytes: int = Field(
        default=0, description="bytes its egress proxy connections received"
    )


class ExecOut(Output):
    exec_id: str
    instance_id: str
    pid: int
    exit_code: int | None = Field(description="null when a signal ended it")
    signal: str | None = Field(description="KILL, TERM, … when a signal ended it")
    reason: Reason | None = Field(
        description="the budget that ended it (timeout, memory, pids, output-limit), or "
        "canceled; null when it ended by itself"
    )
    stdout: StreamOut
    stderr: StreamOut
    encoding: Literal["text", "base64"]
    duration_seconds: float
    usage: UsageOut
    budget: BudgetOut
    enforcement: str = Field(description="how the budget was enforced: cgroup-v2, cgroup-v1, none")
