"""Exec over the agent link: one byte stream (`broker/agentlink/streams.py`) per command.

`plan()` checks everything a request can get wrong before anything runs — stdin size (413),
output limits and the budget (422 naming the field), whether the agent is connected (503),
speaks exec and can enforce the budget (422) — and `slot()` holds one of the instance's
`SANDBOX_EXEC_MAX_PER_INSTANCE` places (429). Then:
- `collect()` (the JSON answer) keeps up to the per-stream limit of stdout and stderr and counts
  the rest (`truncated`);
- `events()` (the NDJSON form) yields `started`, `stdout`/`stderr` chunks as they come, then
  `exit` (or `error`); the caller writes each line before the next is read, so a slow HTTP
  client slows only its own command (the stream's credit goes back only as lines are written).
Stdin goes in the stream's channel 0 as the agent grants credit. If the server gives up (a
caller that goes away, a deadline of the budget's timeout plus a grace period), the stream is
cancelled and the agent kills the run; a link that drops ends the exec with `agent-link-lost`
(the agent kills the run too: an exec does not outlive its link).
Every finished exec is audited (`instance.exec`) and published (`instance.exec.finished`, with
its reason and usage).

Egress bytes: `start()` gets the exec a token from the egress proxy (`use_egress`), which the
agent puts in the run's proxy URL; the bytes of the proxy connections that named it are the
answer's `usage.network_egress_bytes`/`network_ingress_bytes` (see `broker/egress/service.py`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import codecs
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentic_sandbox.broker.agentlink import (
    AgentConnection,
    AgentRegistry,
    Chunk,
    ExecResult,
    ExecSpec,
    ExecStarted,
    LinkClosed,
    ServerStream,
    StreamError,
    StreamLost,
    TooManyStreams,
)
from agentic_sandbox.broker.exec.models import (
    ExecOut,
    ExecRequest,
    StreamOut,
    UsageOut,
)
from agentic_sandbox.broker.http.problems import ProblemError, not_ready, too_many
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.sessions import (
    BudgetOut,
    budget_request_field,
    budget_spec,
    check_budget_support,
    resolve_budget,
)
from agentic_sandbox.provision import Budgets

log = logging.getLogger(__name__)

ACCEPT_TIMEOUT = 30.0  # the agent answers an open at once; under TCG a start can take a while
DEADLINE_GRACE = 30.0  # beyond the budget's timeout, before the server gives up on the agent
STDOUT, STDERR = 1, 2
REFUSAL_STATUS = {"too-many-streams": 429, "unsupported": 501}


def _problem(status: int, detail: str, code: str, where: str = "") -> ProblemError:
    errors = [{"field": where, "message": detail, "type": "value"}] if where else None
    return ProblemError(status, f"{where}: {detail}" if where else detail, code=code, errors=errors)


def refusal_problem(exc: StreamError) -> ProblemError:
    """An agent's refusal as the problem the caller gets."""
    if isinstance(exc, StreamLost):
        return _problem(
            502,
            f"{exc.message}; the command was stopped and its outcome is unknown",
            "agent-link-lost",
        )
    status = REFUSAL_STATUS.get(exc.code)
    if status is not None:
        return ProblemError(
            status,
            exc.message,
            code=exc.code,
            headers={"Retry-After": "5"} if status == 429 else None,
        )
    if exc.code in ("bad-argv", "bad-cwd", "bad-user", "budget-unsupported"):
        return _problem(422, exc.message, exc.code, budget_request_field(exc.field))
    return _problem(502, f"the agent failed to run the command: {exc.message}", "agent-error")


class EgressAccounts(Protocol):
    """The egress proxy's accounting of execs (`broker/egress/service.py`)."""

    def begin_exec(self, instance_id: str, incarnation: str, exec_id: str) -> str: ...

    async def end_exec(self, token: str) -> tuple[int, int]: ...

    def drop_exec(self, token: str) -> None: ...


@dataclass
class ExecPlan:
    exec_id: str
    instance_id: str
    owner: str
    actor: str
    conn: AgentConnection
    spec: ExecSpec
    stdin: bytes | None
    budget: BudgetOut
    limits: dict[int, int]
    encoding: str
    stream: ServerStream | None = None
    pid: int = 0
    enforcement: str = ""
    result: ExecResult | None = None
    egress: tuple[int, int] = (0, 0)  # bytes up, down of its egress proxy connections
    _writer: asyncio.Task[None] | None = field(default=None, repr=False)


def _stdin_bytes(body: ExecRequest) -> bytes | None:
    if body.stdin is not None:
        return body.stdin.encode()
    if body.stdin_base64 is not None:
        try:
            return base64.b64decode(body.stdin_base64, validate=True)
        except (binascii.Error, ValueError):
            raise _problem(422, "not valid base64", "invalid-input", "body.stdin_base64") from None
    return None


class ExecService:
    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.registry = registry
        self._running: dict[str, int] = {}
        self._egress: EgressAccounts | None = None

    def use_egress(self, accounts: EgressAccounts) -> None:
        """Count each exec's egress proxy connections (its `network_egress_bytes`)."""
        self._egress = accounts

    # ---- before anything runs ---------------------------------------------------------------
    def plan(
        self,
        *,
        instance_id: str,
        owner: str,
        actor: str,
        body: ExecRequest,
        loadout_budgets: Budgets,
    ) -> ExecPlan:
        s = self.settings
        stdin = _stdin_bytes(body)
        if stdin is not None and len(stdin) > s.exec_max_stdin_bytes:
            where = "body.stdin" if body.stdin is not None else "body.stdin_base64"
            raise ProblemError(
                413,
                f"{where}: {len(stdin)} bytes of stdin; at most {s.exec_max_stdin_bytes} "
                "(SANDBOX_EXEC_MAX_STDIN_BYTES)",
                code="stdin-too-large",
                errors=[{"field": where, "message": "too large", "type": "too_large"}],
            )
        limits = {}
        for ch, name, asked in (
            (STDOUT, "stdout_limit_bytes", body.stdout_limit_bytes),
            (STDERR, "stderr_limit_bytes", body.stderr_limit_bytes),
        ):
            if asked is not None and asked > s.exec_output_max_bytes:
                raise _problem(
                    422,
                    f"at most {s.exec_output_max_bytes} bytes per stream "
                    "(SANDBOX_EXEC_OUTPUT_MAX_BYTES)",
                    "output-limit-too-large",
                    f"body.{name}",
                )
            limits[ch] = s.exec_output_default_bytes if asked is None else asked
        budget = resolve_budget(body.budget, loadout_budgets)
        conn = self.registry.get(instance_id)
        if conn is None or not conn.ready:
            raise not_ready(f"the agent of instance {instance_id!r} is not connected")
        info = conn.info
        if "exec" not in info.stream_kinds:
            raise ProblemError(
                501,
                f"the agent of instance {instance_id!r} does not run exec (agent version "
                f"{info.agent_version or 'unknown'}; upgrade it)",
                code="exec-unsupported",
            )
        check_budget_support(
            budget, info.budget_enforcement, info.budgets, info.budget_problem, instance_id
        )
        spec = ExecSpec(
            argv=body.argv,
            env=body.env,
            cwd=body.cwd or "",
            user=body.user or "",
            stdin=stdin is not None,
            budget=budget_spec(budget),
        )
        return ExecPlan(
            exec_id=uuid.uuid4().hex[:16],
            instance_id=instance_id,
            owner=owner,
            actor=actor,
            conn=conn,
            spec=spec,
            stdin=stdin,
            budget=budget,
            limits=limits,
            encoding=body.output_encoding,
        )

    @contextlib.contextmanager
    def slot(self, instance_id: str) -> Iterator[None]:
        limit = self.settings.exec_max_per_instance
        running = self._running.get(instance_id, 0)
        if running >= limit:
            raise ProblemError(
                429,
                f"instance {instance_id!r} runs {running} execs (the limit, "
                "SANDBOX_EXEC_MAX_PER_INSTANCE)",
                code="too-many-execs",
                headers={"Retry-After": "5"},
            )
        self._running[instance_id] = running + 1
        try:
            yield
        finally:
            left = self._running[instance_id] - 1
            if left:
                self._running[instance_id] = left
            else:
                del self._running[instance_id]

    # ---- running -----------------------------------------------------------------------------
    async def start(self, plan: ExecPlan) -> None:
        """Open the stream and wait for the agent to start the command (problems if not)."""
        if self._egress is not None:
            plan.spec.egress_token = self._egress.begin_exec(
                plan.instance_id, plan.conn.incarnation, plan.exec_id
            )
        try:
            await self._start(plan)
        except BaseException:
            self._drop_egress(plan)
            raise

    def _drop_egress(self, plan: ExecPlan) -> None:
        if self._egress is not None and plan.spec.egress_token:
            self._egress.drop_exec(plan.spec.egress_token)

    async def _start(self, plan: ExecPlan) -> None:
        try:
            stream = plan.conn.streams.open(plan.spec)
        except TooManyStreams as exc:
            raise too_many(str(exc), 5) from None
        except (LinkClosed, StreamLost) as exc:
            raise not_ready(
                f"the agent of instance {plan.instance_id!r} is not connected: {exc}"
            ) from None
        plan.stream = stream
        try:
            async with asyncio.timeout(ACCEPT_TIMEOUT):
                started = await stream.started()
        except StreamError as exc:
            raise refusal_problem(exc) from None
        except TimeoutError:
            stream.cancel("canceled", "the agent did not start the command in time")
            raise _problem(
                504, "the agent did not start the command in time", "agent-timeout"
            ) from None
        if not isinstance(started, ExecStarted):
            stream.cancel("protocol", "an exec accept without its info")
            raise _problem(502, "the agent answered the exec with no start info", "agent-error")
        plan.pid = started.pid
        plan.enforcement = started.enforcement
        if plan.spec.stdin:
            plan._writer = asyncio.create_task(self._write_stdin(stream, plan.stdin or b""))

    @staticmethod
    async def _write_stdin(stream: ServerStream, data: bytes) -> None:
        with contextlib.suppress(StreamError):
            if data:
                await stream.write(0, data)
            await stream.end(0)

    def stop(self, plan: ExecPlan, why: str) -> None:
        """The server gives up on the exec (cancel; the agent kills the run)."""
        if plan._writer is not None:
            plan._writer.cancel()
        self._drop_egress(plan)
        if plan.stream is not None:
            plan.stream.cancel("canceled", why)

    async def _chunks(self, plan: ExecPlan) -> AsyncGenerator[Chunk, None]:
        """The agent's chunks until its close (then its result in `plan.result`). Problems are
        raised as `ProblemError`; a run left before its end (an error, a caller that goes away,
        the deadline: the budget's timeout plus a grace period, one timer for the whole exec)
        is cancelled."""
        stream = plan.stream
        assert stream is not None
        loop = asyncio.get_running_loop()
        timeout = plan.budget.timeout_seconds
        if timeout is not None:
            stream.expire_at(
                loop.time() + timeout + DEADLINE_GRACE,
                "the agent did not finish the command in time",
            )
        done = False
        try:
            while (chunk := await stream.read()) is not None:
                yield chunk
            result = await stream.result()
            if not isinstance(result, ExecResult):
                raise StreamError("agent-error", "the exec ended without its result")
            plan.result = result
            if self._egress is not None and plan.spec.egress_token:
                plan.egress = await self._egress.end_exec(plan.spec.egress_token)
            done = True
        except StreamError as exc:
            if exc.code == "timeout":
                raise _problem(504, exc.message, "agent-timeout") from None
            raise refusal_problem(exc) from None
        finally:
            if not done:
                self.stop(plan, "the server stopped waiting for the command")

    async def collect(self, plan: ExecPlan) -> ExecOut:
        """Run to the end; the answer keeps up to each stream's limit."""
        kept = {STDOUT: bytearray(), STDERR: bytearray()}
        async for chunk in self._chunks(plan):
            buf = kept.get(chunk.channel)
            if buf is not None and (room := plan.limits[chunk.channel] - len(buf)) > 0:
                buf += chunk.data[:room]
        out = self._answer(plan, self._result(plan), kept)
        self._finished(plan, out)
        return out

    async def events(self, plan: ExecPlan) -> AsyncGenerator[dict[str, Any], None]:
        """The NDJSON form: started, stdout/stderr chunks as they come, exit (or error)."""
        decoders = {
            ch: codecs.getincrementaldecoder("utf-8")(errors="replace") for ch in (STDOUT, STDERR)
        }
        names = {STDOUT: "stdout", STDERR: "stderr"}
        yield {
            "type": "started",
            "exec_id": plan.exec_id,
            "pid": plan.pid,
            "enforcement": plan.enforcement,
            "budget": plan.budget.model_dump(),
        }
        try:
            async for chunk in self._chunks(plan):
                name = names.get(chunk.channel)
                if name is None:
                    continue
                if plan.encoding == "base64":
                    data = base64.b64encode(chunk.data).decode() if chunk.data else ""
                else:
                    data = decoders[chunk.channel].decode(chunk.data, final=chunk.eof)
                if data:
                    yield {"type": name, "data": data}
            out = self._answer(plan, self._result(plan), None)
        except ProblemError as problem:
            yield _error_line(problem)
            return
        self._finished(plan, out)
        yield {"type": "exit", **out.model_dump(mode="json")}

    # ---- the answer ----------------------------------------------------------------------------
    @staticmethod
    def _result(plan: ExecPlan) -> ExecResult:
        if plan.result is None:
            raise refusal_problem(StreamError("agent-error", "no result"))
        return plan.result

    def _answer(self, plan: ExecPlan, r: ExecResult, kept: dict[int, bytearray] | None) -> ExecOut:
        def stream_out(ch: int, written: int) -> StreamOut:
            if kept is None:
                return StreamOut(data="", bytes=written, truncated=False)
            data = bytes(kept[ch])
            text = (
                base64.b64encode(data).decode()
                if plan.encoding == "base64"
                else data.decode("utf-8", "replace")
            )
            return StreamOut(data=text, bytes=written, truncated=written > len(data))

        reason = (
            r.reason
            if r.reason in ("timeout", "memory", "pids", "output-limit", "canceled")
            else None
        )
        return ExecOut(
            exec_id=plan.exec_id,
            instance_id=plan.instance_id,
            pid=plan.pid,
            exit_code=r.code,
            signal=r.signal[:16] or None,
            reason=reason,
            stdout=stream_out(STDOUT, r.stdout_bytes),
            stderr=stream_out(STDERR, r.stderr_bytes),
            encoding=plan.encoding,
            duration_seconds=round(r.duration_us / 1e6, 6),
            usage=UsageOut(
                cpu_seconds=round(r.cpu_us / 1e6, 6),
                peak_memory_bytes=r.peak_memory_bytes,
                output_bytes=r.stdout_bytes + r.stderr_bytes,
                network_egress_bytes=plan.egress[0],
                network_ingress_bytes=plan.egress[1],
            ),
            budget=plan.budget,
            enforcement=(r.enforcement or plan.enforcement)[:32],
        )

    def _finished(self, plan: ExecPlan, out: ExecOut) -> None:
        data = {
            "exec_id": plan.exec_id,
            "argv0": plan.spec.argv[0][:256],
            "exit_code": out.exit_code,
            "signal": out.signal,
            "reason": out.reason,
            "duration_seconds": out.duration_seconds,
            "usage": out.usage.model_dump(),
            "enforcement": out.enforcement,
        }
        self.svc.audit.record(
            plan.actor, "instance.exec", "instance", plan.instance_id, detail=data
        )
        self.svc.events.publish(
            "instance.exec.finished",
            actor=plan.actor,
            instance_id=plan.instance_id,
            owner=plan.owner,
            data=data,
        )
        log.info(
            "exec %s on %s finished: %s",
            plan.exec_id,
            plan.instance_id,
            out.reason or out.signal or out.exit_code,
            extra={"instance_id": plan.instance_id, "exec_id": plan.exec_id},
        )


def _error_line(problem: ProblemError) -> dict[str, Any]:
    return {
        "type": "error",
        "status": problem.status,
        "code": problem.code,
        "detail": problem.detail,
    }
