"""`GET /api/v2/admin/sessions/{session_id}/attach` — the session WebSocket (`sandbox.pty.v1`).

Authentication is the usual middleware (the `bearer.<token>` subprotocol for programs, the
dashboard cookie for browsers; a cookie-authenticated upgrade must come from the same origin).
Per-message compression is off. The handler reads client frames and hands them to the hub's
control arbiter (`control.py`); the client's writer task (see clients.py) sends everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Literal
from urllib.parse import urlsplit

from aiohttp import WSCloseCode, WSMsgType, web
from pydantic import ConfigDict, Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.problems import ProblemError, not_found
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody
from agentic_sandbox.broker.http.schemas import Input
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.access import require_visible
from agentic_sandbox.broker.sessions.clients import AttachedClient
from agentic_sandbox.broker.sessions.control import ControlArbiter
from agentic_sandbox.broker.sessions.hub import HUB_KEY, SessionHub
from agentic_sandbox.broker.sessions.session import HubSession

log = logging.getLogger(__name__)

api = ApiRoutes()

# Frames above this are refused by aiohttp itself (close 1009); below it, frames over the
# protocol limits (64 KiB input, 8 KiB control) get an `error` frame and the session goes on.
WS_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class AttachQuery(Input):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    role: Literal["control", "observe"] = Field(
        default="observe", description="ask for control (granted if free) or only observe"
    )
    from_: int | None = Field(
        default=None,
        alias="from",
        ge=0,
        le=2**62,
        description="resume at this output offset (lossless reconnect); omit for a snapshot",
    )


class WebSocketTransport:
    def __init__(self, ws: web.WebSocketResponse, request: web.Request) -> None:
        self.ws = ws
        self._raw = request.transport

    async def send_text(self, text: str) -> None:
        await self.ws.send_str(text)

    async def send_binary(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def close(self, code: int, message: str) -> None:
        await self.ws.close(code=code, message=message.encode())

    def abort(self) -> None:
        if self._raw is not None:
            self._raw.abort()

    def backed_up(self) -> bool:
        return self._raw is None or self._raw.get_write_buffer_size() > 0


def _same_origin(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    if not origin:
        return True
    parts = urlsplit(origin)
    return parts.netloc == request.host


@api.get(
    "/api/v2/admin/sessions/{session_id}/attach",
    query=AttachQuery,
    websocket=True,
    role=Role.viewer,
    summary="Attach to a session's terminal (WebSocket, subprotocol sandbox.pty.v1)",
    description=(
        "Server->client binary frames: 8-byte big-endian offset then output bytes. "
        "Client->server binary frames: input (controller only). Text frames: JSON control "
        "messages (server: hello, role, members, resize, resync, exit, error, pong; client: "
        "resize, request_control {force}, release_control, signal {INT|TERM|KILL|HUP}, ping). "
        "Authenticate with the subprotocol `bearer.<token>` or the dashboard cookie."
    ),
    tag="sessions",
    responses={
        400: "not a WebSocket upgrade, or the sandbox.pty.v1 subprotocol is missing",
        409: "the session has ended and is no longer held",
    },
)
async def attach_session(call: Call[NoBody, AttachQuery]) -> web.StreamResponse:
    # Why the steps run in this order:
    # - Visibility before anything that differs per session: a stranger gets the same 404 for
    #   a live session, an ended one and one that never existed (ids leak nothing).
    # - Every refusal (origin, upgrade, subprotocol, observer cap) is a problem+json answer
    #   *before* `ws.prepare`: after the 101 only a close code can say what went wrong.
    # - The cookie origin check guards against cross-site WebSocket hijacking: a browser sends
    #   the cookie to any page's socket, a bearer token it never sends on its own.
    # - The stream lease is taken before the client joins, and its revoke hook detaches the
    #   client synchronously, so no input sent after a revocation reaches the PTY.
    # - The writer task starts only after the hook is set; teardown detaches first (the hub
    #   stops routing output to it), then stops the writer, then releases the lease.
    request = call.request
    svc = services(request)
    who = call.require_principal()
    hub: SessionHub = request.app[HUB_KEY]
    session_id = call.match["session_id"]
    sess = hub.get(session_id)
    if sess is None:
        from agentic_sandbox.broker.store import models as m

        async with svc.db.session() as s:
            row = await s.get(m.Session, session_id)
        if row is None:
            raise not_found("session", session_id)
        await require_visible(
            svc.db, who, session_id=row.id, owner=row.owner, instance_id=row.instance_id
        )
        raise ProblemError(
            409,
            f"session {session_id} has ended ({row.state}) and is no longer held; "
            "its recording is at /recording",
            code="session-gone",
        )
    may_control = await require_visible(
        svc.db, who, session_id=sess.id, owner=sess.owner, instance_id=sess.instance_id
    )
    if who.kind == "cookie" and not _same_origin(request):
        raise ProblemError(403, "cross-origin WebSocket with a cookie", code="bad-origin")
    ws = web.WebSocketResponse(
        protocols=(proto.SUBPROTOCOL,),
        compress=False,
        max_msg_size=WS_MAX_MESSAGE_BYTES,
        heartbeat=30.0,
    )
    ready = ws.can_prepare(request)
    if not ready.ok:
        raise ProblemError(400, "this route needs a WebSocket upgrade", code="websocket-required")
    if ready.protocol != proto.SUBPROTOCOL:
        raise ProblemError(
            400,
            f"offer the WebSocket subprotocol {proto.SUBPROTOCOL}",
            code="subprotocol-required",
        )
    want_control = call.query.role == "control"
    control_free = sess.controller is None and may_control and not sess.ended
    limit = svc.settings.session_max_observers
    if not (want_control and control_free) and sess.observers() >= limit:
        raise ProblemError(
            429,
            f"this session has the maximum of {svc.settings.session_max_observers} observers",
            code="too-many-observers",
            headers={"Retry-After": "5"},
        )
    # Leased under the caller's credentials: revoking them ends this connection at once.
    lease = svc.streams.open(who, "ws")
    closing: list[asyncio.Task[bool]] = []
    try:
        await ws.prepare(request)
        control = hub.control
        client = control.attach(
            sess,
            who,
            WebSocketTransport(ws, request),
            want_control=want_control,
            may_control=may_control,
            from_offset=call.query.from_,
        )

        def revoked(reason: str) -> None:
            # Synchronously: from here on nothing this client sends is applied.
            client.close_reason = f"credential revoked: {reason}"
            control.detach(sess, client)
            closing.append(
                asyncio.create_task(
                    ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"credential revoked")
                )
            )

        lease.on_revoke(revoked)
        client.task = asyncio.create_task(client.run(), name=f"ws-writer-{client.id}")
        try:
            async for msg in ws:
                if client.closed:
                    break
                if msg.type == WSMsgType.BINARY:
                    control.input(sess, client, msg.data)
                elif msg.type == WSMsgType.TEXT:
                    _control(control, sess, client, msg.data)
                elif msg.type in (WSMsgType.ERROR, WSMsgType.CLOSE, WSMsgType.CLOSING):
                    break
        except (ConnectionError, RuntimeError) as exc:
            log.debug("attach connection ended: %s", exc)
        finally:
            control.detach(sess, client)
            client.closed = True
            client.wake.set()
            if client.task is not None and not client.task.done():
                client.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client.task
    finally:
        lease.release()
        for task in closing:
            with contextlib.suppress(Exception):
                await task
    return ws


def _control(control: ControlArbiter, sess: HubSession, client: AttachedClient, text: str) -> None:
    try:
        msg = proto.parse_client_text(text)
    except proto.ProtocolError as exc:
        client.queue(proto.error(exc.code, exc.message))
        return
    if isinstance(msg, proto.ResizeMsg):
        control.resize(sess, client, msg.cols, msg.rows)
    elif isinstance(msg, proto.RequestControlMsg):
        control.request(sess, client, msg.force)
    elif isinstance(msg, proto.ReleaseControlMsg):
        control.release(sess, client)
    elif isinstance(msg, proto.SignalMsg):
        control.signal(sess, client, msg.signal)
    else:
        client.queue(proto.pong(msg.id))
