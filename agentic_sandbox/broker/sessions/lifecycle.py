"""A session's state transitions, each one persisted, and the meaningful ones audited,
published and counted (see `states.py` for the states).

`end` is the one way a session ends (exited, failed or lost), whatever ended it: the agent's
exit report, a failed open, reconciliation finding it gone, or its instance's incarnation
ending. It closes the output stream first (held bytes masked, HITL stopped), then records the
end everywhere and wakes everyone waiting on the session: exit waiters, a pending open, client
writers (which send the exit after the last output) and followers.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions.contract import ExitStatus, SessionError
from agentic_sandbox.broker.sessions.output import OutputPipeline
from agentic_sandbox.broker.sessions.rows import SessionRows
from agentic_sandbox.broker.sessions.session import HubSession, publish
from agentic_sandbox.broker.sessions.states import SessionState
from agentic_sandbox.broker.sessions.trust import EXIT_REASON_CHARS


class Lifecycle:
    def __init__(
        self,
        metrics: Metrics,
        events: EventBus,
        audit: AuditLog,
        rows: SessionRows,
        output: OutputPipeline,
    ) -> None:
        self._metrics = metrics
        self._events = events
        self._audit = audit
        self._rows = rows
        self._output = output

    def move(self, sess: HubSession, state: SessionState) -> None:
        """A live session's state changes (running, killing): only persisted."""
        sess.state = state
        self._rows.persist(sess.id, state=state.value)

    def opened(self, sess: HubSession, *, actor: str, pid: int, cols: int, rows: int) -> None:
        """The agent started the session's process (created at `cols` x `rows`)."""
        if sess.state == SessionState.starting:
            self.move(sess, SessionState.running)
        self._metrics.sessions_opened.labels("ok").inc()
        self._audit.transition(
            actor,
            "session",
            sess.id,
            SessionState.starting.value,
            SessionState.running.value,
            cause="created",
            detail={"instance_id": sess.instance_id},
        )
        publish(
            self._events,
            sess,
            "session.created",
            actor=actor,
            data={
                "name": sess.name,
                "command": sess.command,
                "cols": cols,
                "rows": rows,
                "pid": pid,
            },
        )

    def open_failed(self, sess: HubSession, reason: str, *, actor: str) -> None:
        self._metrics.sessions_opened.labels("failed").inc()
        self.end(
            sess,
            SessionState.failed,
            ExitStatus(code=None, lost=False, reason=reason),
            actor=actor,
        )

    def kill_requested(self, sess: HubSession, *, actor: str) -> None:
        """A kill was asked for (audited and published the first time only)."""
        first = not sess.kill_requested
        sess.kill_requested = True
        if first:
            self._audit.record(actor, "session.kill", "session", sess.id)
            publish(self._events, sess, "session.kill_requested", actor=actor)
        if sess.state != SessionState.starting:
            self.move(sess, SessionState.killing)

    def end(self, sess: HubSession, state: SessionState, status: ExitStatus, *, actor: str) -> None:
        """The session ended (`state` is exited, failed or lost); a second end is ignored."""
        if sess.ended:
            return
        previous = sess.state
        self._output.end_stream(sess)
        sess.state = state
        sess.exit = status
        sess.ended_mono = asyncio.get_running_loop().time()
        sess.close_recording()
        now = dt.datetime.now(dt.UTC)
        sess.ended_at = now
        sess.persisted_offset = sess.ring.end
        self._rows.persist(
            sess.id,
            state=state.value,
            exit_code=status.code,
            exit_signal=status.signal,
            exit_reason=status.reason[:EXIT_REASON_CHARS],
            ended_at=now,
            output_offset=sess.ring.end,
        )
        if state == SessionState.lost:
            how = "lost"
        elif sess.kill_requested:
            how = "killed"
        else:
            how = "failed" if state == SessionState.failed else "exited"
        self._metrics.session_ends.labels(how).inc()
        self._audit.transition(
            actor,
            "session",
            sess.id,
            previous.value,
            state.value,
            cause=status.reason or how,
            detail={"code": status.code, "signal": status.signal},
        )
        publish(
            self._events,
            sess,
            f"session.{state.value}",
            actor=actor,
            data={
                "code": status.code,
                "signal": status.signal,
                "lost": status.lost,
                "reason": status.reason,
                "output_bytes": sess.ring.end,
                "killed": sess.kill_requested,
                "exceeded": status.exceeded or None,
                "usage": status.usage.view() if status.usage is not None else None,
            },
        )
        for fut in sess.exit_waiters:
            if not fut.done():
                fut.set_result(status)
        sess.exit_waiters.clear()
        if sess.opening is not None and not sess.opening.done():
            sess.opening.set_exception(SessionError(status.reason or "session ended"))
        sess.notify()
