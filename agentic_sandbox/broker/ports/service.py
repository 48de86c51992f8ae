"""Port streams: one TCP connection to 127.0.0.1:PORT in an instance per stream of kind `port`.

What the proxy and the tunnel share: the instance's live agent link (`target`), the limit on
concurrent port streams per instance (`SANDBOX_PORTS_MAX_STREAMS_PER_INSTANCE`, a 429 naming
it), opening a stream and waiting for the agent's connect (its refusals as problems naming the
port: `connection-refused` is a 502, a bad port a 422), and the audit row and event of every
open (`instance.port.open`, outcome ok or the refusal's code).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from agentic_sandbox.broker.agentlink import (
    AgentConnection,
    AgentRegistry,
    LinkClosed,
    PortSpec,
    ServerStream,
    StreamError,
    StreamLost,
    TooManyStreams,
)
from agentic_sandbox.broker.http.problems import ProblemError, not_ready
from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0  # the agent connects on the guest's loopback (its own timeout is 10 s)
TO_PORT, FROM_PORT = 0, 1
WINDOW = 1024 * 1024  # what the agent may send before credit (a bulk answer: fewer round trips)
#: the agent's refusal codes: HTTP status, problem code
AGENT_CODES: dict[str, tuple[int, str]] = {
    "bad-port": (422, "bad-port"),
    "connection-refused": (502, "connection-refused"),
    "connect-timeout": (504, "connect-timeout"),
    "connect-failed": (502, "connect-failed"),
    "too-many-streams": (429, "too-many-streams"),
    "unsupported": (501, "ports-unsupported"),
}


def check_port(raw: str) -> int:
    """The `{port}` of a path: 1-65535, else a 422 naming it."""
    port = int(raw) if raw.isdigit() and len(raw) <= 5 else 0
    if not 1 <= port <= 65535:
        raise ProblemError(
            422,
            f"port {raw[:16]!r} is not a TCP port (1-65535)",
            code="bad-port",
            errors=[{"field": "path.port", "message": "must be 1-65535", "type": "bad-port"}],
        )
    return port


def problem(exc: StreamError, port: int) -> ProblemError:
    """A refusal (or a lost stream) as the caller's problem, naming the port and the reason."""
    if isinstance(exc, StreamLost):
        if exc.code == "timeout":
            return ProblemError(504, f"port {port}: {exc.message}", code="agent-timeout")
        return ProblemError(502, f"port {port}: {exc.message}", code="agent-link-lost")
    status, code = AGENT_CODES.get(exc.code, (502, "agent-error"))
    return ProblemError(
        status,
        f"port {port}: {exc.message}",
        code=code,
        errors=[{"field": "path.port", "message": exc.message, "type": exc.code}],
        extra={"port": port, "reason": exc.code},
        headers={"Retry-After": "5"} if status == 429 else None,
    )


@dataclass
class Target:
    """The instance a request reaches into: its live agent link and who asks."""

    instance_id: str
    owner: str
    actor: str
    conn: AgentConnection


class PortsService:
    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.registry = registry
        self._open: dict[str, int] = {}

    def target(self, *, instance_id: str, incarnation: str, owner: str, actor: str) -> Target:
        conn = self.registry.get(instance_id)
        if conn is None or not conn.ready or conn.incarnation != incarnation:
            raise not_ready(f"the agent of instance {instance_id!r} is not connected")
        if "port" not in conn.info.stream_kinds:
            raise ProblemError(
                501,
                f"the agent of instance {instance_id!r} does not open ports (agent version "
                f"{conn.info.agent_version or 'unknown'}; upgrade it)",
                code="ports-unsupported",
            )
        return Target(instance_id, owner, actor, conn)

    def streams_open(self, instance_id: str) -> int:
        return self._open.get(instance_id, 0)

    @contextlib.contextmanager
    def slot(self, instance_id: str) -> Iterator[None]:
        """One of the instance's `SANDBOX_PORTS_MAX_STREAMS_PER_INSTANCE` places (429)."""
        limit = self.settings.ports_max_streams_per_instance
        running = self._open.get(instance_id, 0)
        if running >= limit:
            raise ProblemError(
                429,
                f"instance {instance_id!r} has {running} port streams open (the limit, "
                "SANDBOX_PORTS_MAX_STREAMS_PER_INSTANCE)",
                code="too-many-port-streams",
                headers={"Retry-After": "1"},
                extra={"limit": limit},
            )
        self._open[instance_id] = running + 1
        try:
            yield
        finally:
            left = self._open[instance_id] - 1
            if left:
                self._open[instance_id] = left
            else:
                del self._open[instance_id]

    async def open(self, t: Target, port: int, via: str, what: str = "") -> ServerStream:
        """A connected stream to `port` (within a slot the caller holds); audited either way."""
        try:
            stream = t.conn.streams.open(PortSpec(port), window=WINDOW)
        except TooManyStreams as exc:
            raise ProblemError(429, str(exc), code="too-many-streams") from None
        except (LinkClosed, StreamLost) as exc:
            raise not_ready(
                f"the agent of instance {t.instance_id!r} is not connected: {exc}"
            ) from None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await stream.started()
        except StreamError as exc:
            self._audit(t, port, via, what, exc.code)
            raise problem(exc, port) from None
        except TimeoutError:
            stream.cancel("canceled", "the agent did not connect in time")
            self._audit(t, port, via, what, "agent-timeout")
            raise ProblemError(
                504, f"port {port}: the agent did not connect in time", code="agent-timeout"
            ) from None
        self._audit(t, port, via, what, "ok")
        return stream

    def _audit(self, t: Target, port: int, via: str, what: str, outcome: str) -> None:
        detail: dict[str, object] = {"port": port, "via": via}
        if what:
            detail["request"] = what[:300]
        self.svc.audit.record(
            t.actor,
            "instance.port.open",
            "instance",
            t.instance_id,
            outcome=outcome,
            cause=f"port {port} ({via})",
            detail=detail,
        )
        self.svc.events.publish(
            "instance.port.opened" if outcome == "ok" else "instance.port.refused",
            actor=t.actor,
            instance_id=t.instance_id,
            owner=t.owner or None,
            data={**detail, "outcome": outcome},
        )
