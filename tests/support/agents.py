"""Real `agent-client` processes on the host, enrolled for host-agent instances.

    agent = start_agent(server, "web-1", tmp_path)   # instance record + token + enroll + link
    ...
    agent.kill9() / agent.stop()

`register_host_instance` + `enrollment_token` are the two admin calls an operator makes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.lifetime import die_with_parent
from tests.support.server import ROOT, ServerProcess


def register_host_instance(
    server: ServerProcess, instance_id: str, *, token: str | None = None, **profile: object
) -> dict[str, object]:
    """Register a host instance through the API; `profile` is what the registration may
    declare (`skills`, `task_runner`, `budgets`), as a user would."""
    out: dict[str, object] = server.ok(
        "POST",
        "/api/v2/admin/agents/host-instances",
        {"instance_id": instance_id, "description": "test agent", **profile},
        token=token,
    )
    return out


def enrollment_token(
    server: ServerProcess, instance_id: str, *, ttl: int | None = None, token: str | None = None
) -> str:
    body = {} if ttl is None else {"ttl_seconds": ttl}
    out = server.ok(
        "POST", f"/api/v2/admin/instances/{instance_id}/enrollment-tokens", body, token=token
    )
    return str(out["token"])


class AgentProcess:
    def __init__(
        self,
        server: ServerProcess,
        instance_id: str,
        state_dir: Path,
        *,
        enrollment_token: str = "",
        extra_args: list[str] | None = None,
        initial_backoff: float = 0.1,
        max_backoff: float = 1.0,
    ) -> None:
        self.server = server
        self.instance_id = instance_id
        self.state_dir = state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token_file = state_dir.parent / f"{instance_id}.token"
        if enrollment_token:
            self.token_file.write_text(enrollment_token)
            os.chmod(self.token_file, 0o600)
        self.extra_args = list(extra_args or [])
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.log_path = state_dir.parent / f"{instance_id}.agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "agentic_sandbox.agent.main",
            "--instance-id",
            self.instance_id,
            "--server",
            self.server.grpc_target,
            "--enroll-server",
            self.server.enroll_target,
            "--ca-cert",
            str(self.server.ca_path),
            "--enrollment-token-file",
            str(self.token_file),
            "--state-dir",
            str(self.state_dir),
            "--initial-backoff",
            str(self.initial_backoff),
            "--max-backoff",
            str(self.max_backoff),
            "--log-format",
            "json",
            *self.extra_args,
        ]

    def start(self) -> AgentProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
        env["PYTHONUNBUFFERED"] = "1"
        # Sessions inherit the agent's HOME: login shells on this host must not run the machine
        # user's profile (pyenv rehash, cargo …) — slow, and a shell killed in the middle of a
        # pyenv rehash leaves a lock that hangs every later login shell.
        home = self.state_dir.parent / "home"
        home.mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(home)
        self.proc = subprocess.Popen(
            self.argv(),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_connected(self, timeout: float = 30.0, *, since: float | None = None) -> None:
        """Until the server reports this agent `connected` (after `since`, a time.time())."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"agent-client exited:\n{self.log_text()[-3000:]}")
            try:
                status, body = self.server.api(
                    "GET", f"/api/v2/admin/agents/{self.instance_id}", timeout=5
                )
            except OSError:
                status, body = 0, None
            if (
                status == 200
                and body["state"] == "connected"
                and (since is None or _ts(body.get("connected_at")) >= since)
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"agent {self.instance_id} not connected after {timeout}s:\n"
            f"{self.log_text()[-3000:]}\n--- server ---\n{self.server.log_tail()}"
        )

    def worker_pid(self, timeout: float = 30.0) -> int:
        """The pid of the agent's worker (the session keeper's child, `agent/keeper.py`)."""
        assert self.proc is not None
        keeper = self.proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                kids = Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split()
            except OSError:
                kids = []
            for kid in kids:
                try:
                    cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"agentic_sandbox.agent.main" in cmdline:
                    return int(kid)
            time.sleep(0.05)
        raise RuntimeError(f"no worker under the keeper {keeper}:\n{self.log_text()[-2000:]}")

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        # sessions of the agent are its children in its process group: make sure they go
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _ts(value: object) -> float:
    import datetime as dt

    if not isinstance(value, str):
        return 0.0
    return dt.datetime.fromisoformat(value).timestamp()


def start_agent(
    server: ServerProcess,
    instance_id: str,
    workdir: Path,
    *,
    register: bool = True,
    extra_args: list[str] | None = None,
    wait: bool = True,
    profile: dict[str, Any] | None = None,
) -> AgentProcess:
    """Register a host instance (declaring `profile`: skills, task runner, budgets), make an
    enrollment token, start and wait for the agent."""
    if register:
        register_host_instance(server, instance_id, **(profile or {}))
    token = enrollment_token(server, instance_id)
    agent = AgentProcess(
        server,
        instance_id,
        workdir / f"agent-{instance_id}",
        enrollment_token=token,
        extra_args=extra_args,
    )
    agent.start()
    if wait:
        agent.wait_connected()
    return agent
