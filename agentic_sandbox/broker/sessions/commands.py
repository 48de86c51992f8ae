"""What the hub asks of a session's agent: input, resize, signal, close.

`AgentCommands.link` finds the instance's ready link (else `AgentUnavailable`), and
`closed_is_unavailable` is the one place where a link that closes under a command (or
overflows) becomes the contract's `AgentUnavailable`. Input is forwarded at once, never batched
(a keystroke's echo is what the user waits for).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING

from agentic_sandbox.broker.agentlink import AgentConnection, LinkClosed, SignalName
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.contract import AgentUnavailable
from agentic_sandbox.broker.sessions.rows import SessionRows
from agentic_sandbox.broker.sessions.session import HubSession

if TYPE_CHECKING:
    from agentic_sandbox.broker.agentlink import AgentRegistry


class _ClosedIsUnavailable:
    """`with closed_is_unavailable:` a command on a link that is (or becomes) closed raises
    `AgentUnavailable`. (A class, not a generator context manager: this is on every keystroke's
    path, and it costs a sixth as much.)"""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, LinkClosed):
            raise AgentUnavailable(str(exc)) from None


closed_is_unavailable = _ClosedIsUnavailable()


class AgentCommands:
    def __init__(self, settings: Settings, metrics: Metrics, rows: SessionRows) -> None:
        self._grace_ms = int(settings.session_kill_grace_seconds * 1000)
        self._input_bytes = metrics.session_input_bytes
        self._rows = rows
        self.registry: AgentRegistry | None = None

    def use_registry(self, registry: AgentRegistry) -> None:
        self.registry = registry

    def ready(self, instance_id: str) -> bool:
        return self.registry is not None and self.registry.ready(instance_id)

    def current(self, instance_id: str) -> AgentConnection | None:
        """The instance's link, ready or not."""
        return self.registry.get(instance_id) if self.registry is not None else None

    def link(self, instance_id: str) -> AgentConnection:
        """The instance's ready link; `AgentUnavailable` when there is none."""
        conn = self.registry.get(instance_id) if self.registry is not None else None
        if conn is None or not conn.ready:
            raise AgentUnavailable(f"the agent of instance {instance_id!r} is not connected")
        return conn

    def send_input(self, sess: HubSession, data: bytes) -> None:
        with closed_is_unavailable:
            self.link(sess.instance_id).send_input(sess.id, data)
        self._input_bytes.inc(len(data))
        if sess.recording is not None:
            sess.recording.input(data)

    def signal(self, sess: HubSession, signal: SignalName) -> None:
        with closed_is_unavailable:
            self.link(sess.instance_id).signal(sess.id, signal)

    def resize(self, sess: HubSession, cols: int, rows: int) -> None:
        """The PTY's new size: sent to the agent, then applied here and told to every client."""
        if (cols, rows) == (sess.cols, sess.rows):
            return
        with closed_is_unavailable:
            self.link(sess.instance_id).resize(sess.id, cols, rows)
        sess.set_size(cols, rows)
        self._rows.persist(sess.id, cols=cols, rows=rows)
        msg = proto.resize(cols, rows)
        for client in sess.clients.values():
            client.queue(msg)

    def kill(self, sess: HubSession) -> None:
        """Ask the agent to end the session (HUP, then KILL after the grace period); without a
        ready link nothing is sent: the agent is told to end it when it registers again."""
        with contextlib.suppress(AgentUnavailable), closed_is_unavailable:
            self.link(sess.instance_id).close_session(sess.id, self._grace_ms)
