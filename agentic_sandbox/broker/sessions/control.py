"""Attached clients and control arbitration: at most one controller per session.

A client attaching with `role=control` gets the lease if it is free and the caller may control
the session (`access.py`: the operator role and ownership, or admin, or a control share);
otherwise it observes, told why (`forbidden`, `control-held`). `request_control` with `force`
takes a held lease (the previous controller is told it observes now); `release_control` gives it
up; a controller that detaches releases it. Only the controller writes, resizes and signals:
anyone else gets `not-controller` and nothing reaches the PTY.

The attach WebSocket (`attach.py`) calls in here for everything a client sends; the messages to
clients are `protocol.py`'s builders.
"""

from __future__ import annotations

from typing import Any

from agentic_sandbox.broker.agentlink import SignalName
from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.clients import AttachedClient, ClientTransport
from agentic_sandbox.broker.sessions.commands import AgentCommands
from agentic_sandbox.broker.sessions.contract import AgentUnavailable
from agentic_sandbox.broker.sessions.session import HubSession, publish

OBSERVE_ONLY = "you may only observe this session (control needs the operator role and ownership)"
SESSION_ENDED = "the session has ended"


def _control_held(holder: AttachedClient) -> str:
    return proto.error(
        "control-held", f"{holder.subject} has control; request_control with force takes it"
    )


class ControlArbiter:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        events: EventBus,
        audit: AuditLog,
        commands: AgentCommands,
    ) -> None:
        self._max_lag = settings.session_client_max_lag_bytes
        self._frame_bytes = settings.session_frame_bytes
        self._relayed = metrics.session_relayed_bytes
        self._resyncs = metrics.session_resyncs
        self._events = events
        self._audit = audit
        self._commands = commands

    # ---- attach and detach -------------------------------------------------------------------
    def attach(
        self,
        sess: HubSession,
        principal: Principal,
        transport: ClientTransport,
        *,
        want_control: bool,
        may_control: bool,
        from_offset: int | None,
    ) -> AttachedClient:
        """A new client of the session; its first messages (`hello`, maybe an `error` saying
        why it observes) are queued. The caller runs its writer (`client.run()`)."""
        client = AttachedClient(
            sess,
            principal,
            transport,
            may_control=may_control,
            max_lag=self._max_lag,
            frame_bytes=self._frame_bytes,
            relayed=self._relayed,
            resyncs=self._resyncs,
        )
        notice: str | None = None
        if want_control and not sess.ended:
            if not may_control:
                notice = proto.error("forbidden", OBSERVE_ONLY)
            elif sess.controller is None:
                client.role = proto.ROLE_CONTROLLER
                sess.controller = client
            else:
                notice = _control_held(sess.controller)
        ring = sess.ring
        if from_offset is None:
            client.pending_resync = "initial"
        elif ring.start <= from_offset <= max(ring.end, sess.agent_end) or (
            from_offset > ring.end and not sess.synced and not sess.ended
        ):
            client.offset = from_offset  # held, or still to come from the agent
        else:
            client.pending_resync = "offset-unavailable"
        client.catchup_until = max(ring.end, sess.agent_end)
        sess.clients[client.id] = client
        client.queue(
            proto.hello(
                session=sess.id,
                instance=sess.instance_id,
                you=client.id,
                role=client.role,
                cols=sess.cols,
                rows=sess.rows,
                state=sess.state.value,
                start=ring.start,
                end=ring.end,
                from_=client.offset if client.pending_resync is None else None,
                members=sess.members(),
            )
        )
        if notice is not None:
            client.queue(notice)
        self._broadcast_members(sess, skip=client)
        self._publish(sess, client, "session.attached", {"client": client.id, "role": client.role})
        return client

    def detach(self, sess: HubSession, client: AttachedClient) -> None:
        """The client is gone (closed, kicked, revoked): its lease is released (idempotent)."""
        if sess.clients.pop(client.id, None) is None:
            return
        client.closed = True
        client.wake.set()
        if sess.controller is client:
            sess.controller = None
            self._publish(
                sess,
                client,
                "session.control",
                {"controller": None, "reason": "controller disconnected"},
            )
        self._broadcast_members(sess)
        self._publish(
            sess,
            client,
            "session.detached",
            {"client": client.id, "reason": client.close_reason or "closed"},
        )

    # ---- the lease ---------------------------------------------------------------------------
    def request(self, sess: HubSession, client: AttachedClient, force: bool) -> None:
        if sess.ended:
            client.queue(proto.error("session-ended", SESSION_ENDED))
            return
        if sess.controller is client:
            self._set_role(client, proto.ROLE_CONTROLLER, "you already have control")
            return
        if not client.may_control:
            client.queue(proto.error("forbidden", OBSERVE_ONLY))
            return
        previous = sess.controller
        if previous is not None and not force:
            client.queue(_control_held(previous))
            return
        if previous is not None:
            self._set_role(
                previous, proto.ROLE_OBSERVER, f"control taken by {client.subject} (force)"
            )
            self._audit.record(
                client.principal.actor,
                "session.control.force",
                "session",
                sess.id,
                detail={"from": previous.principal.actor},
            )
        sess.controller = client
        self._set_role(
            client,
            proto.ROLE_CONTROLLER,
            "forced takeover" if previous is not None else "control was free",
        )
        self._publish(
            sess,
            client,
            "session.control",
            {"controller": client.subject, "client": client.id, "forced": previous is not None},
        )
        self._broadcast_members(sess)

    def release(self, sess: HubSession, client: AttachedClient) -> None:
        if sess.controller is not client:
            client.queue(proto.error("not-controller", "you do not have control"))
            return
        sess.controller = None
        self._set_role(client, proto.ROLE_OBSERVER, "released")
        self._publish(sess, client, "session.control", {"controller": None, "reason": "released"})
        self._broadcast_members(sess)

    # ---- the controller's commands -------------------------------------------------------------
    def input(self, sess: HubSession, client: AttachedClient, data: bytes) -> None:
        if sess.controller is not client:
            client.queue(
                proto.error("not-controller", "observers cannot write; request_control first")
            )
            return
        if len(data) > proto.MAX_INPUT_BYTES:
            client.queue(
                proto.error(
                    "frame-too-large", f"input frames are at most {proto.MAX_INPUT_BYTES} bytes"
                )
            )
            return
        if sess.ended:
            client.queue(proto.error("session-ended", SESSION_ENDED))
            return
        if not data:
            return
        try:
            self._commands.send_input(sess, data)
        except AgentUnavailable as exc:
            client.queue(proto.error("agent-unavailable", str(exc)))

    def resize(self, sess: HubSession, client: AttachedClient, cols: int, rows: int) -> None:
        if sess.controller is not client:
            client.queue(
                proto.error("not-controller", "only the controller resizes; the PTY has its size")
            )
            return
        if sess.ended:
            client.queue(proto.error("session-ended", SESSION_ENDED))
            return
        try:
            self._commands.resize(sess, cols, rows)
        except AgentUnavailable as exc:
            client.queue(proto.error("agent-unavailable", str(exc)))

    def signal(self, sess: HubSession, client: AttachedClient, name: SignalName) -> None:
        if sess.controller is not client:
            client.queue(proto.error("not-controller", "only the controller sends signals"))
            return
        if sess.ended:
            client.queue(proto.error("session-ended", SESSION_ENDED))
            return
        try:
            self._commands.signal(sess, name)
        except AgentUnavailable as exc:
            client.queue(proto.error("agent-unavailable", str(exc)))

    # ---- telling clients ---------------------------------------------------------------------
    def _broadcast_members(self, sess: HubSession, skip: AttachedClient | None = None) -> None:
        msg = proto.members(sess.members())
        for client in sess.clients.values():
            if client is not skip:
                client.queue(msg)

    @staticmethod
    def _set_role(client: AttachedClient, role: proto.ClientRole, reason: str) -> None:
        client.role = role
        client.queue(proto.role(role, reason))

    def _publish(
        self, sess: HubSession, client: AttachedClient, type_: str, data: dict[str, Any]
    ) -> None:
        publish(self._events, sess, type_, actor=client.principal.actor, data=data, with_task=False)
