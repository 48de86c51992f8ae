"""`/api/v2/admin/instances/{id}/ports/{port}/{path…}` (the reverse proxy: HTTP and WebSocket
upgrades) and `/api/v2/admin/instances/{id}/tunnels/{port}` (a raw TCP tunnel as a WebSocket,
for `sandboxctl instance port-forward`).

Roles (a choice, written down): opening a port is a change — whatever listens there may act on
any request (a dev server's POST, a debugger) — so it needs the operator role and an instance
the caller owns (or any, as an admin), as exec does; viewers get 403, another owner's instance
is a 404. The dashboard's cookie works for safe methods (a preview); a cookie-authenticated
POST/PUT/… needs `X-CSRF-Token` like every other route, and a cookie-authenticated WebSocket
must come from this origin. Every open is audited (`instance.port.open`) and published
(`instance.port.opened` / `instance.port.refused`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import ApiRoutes, Call
from agentic_sandbox.broker.instances import instance_to_change
from agentic_sandbox.broker.ports.proxy import forward, is_websocket
from agentic_sandbox.broker.ports.service import PortsService, Target, check_port
from agentic_sandbox.broker.ports.tunnel import SUBPROTOCOL, relay
from agentic_sandbox.broker.services import services

api = ApiRoutes()
Handler = Callable[[Call[Any, Any]], Awaitable[web.StreamResponse]]

PORTS_KEY: web.AppKey[PortsService] = web.AppKey("ports_service")
BASE = "/api/v2/admin/instances/{instance_id}/ports/{port}"
TUNNEL = "/api/v2/admin/instances/{instance_id}/tunnels/{port}"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
ERRORS = {
    403: "the operator role is needed; a cookie change without X-CSRF-Token; a cross-origin "
    "WebSocket with a cookie",
    422: "the port is not 1-65535 (bad-port)",
    429: "too many port streams on the instance (SANDBOX_PORTS_MAX_STREAMS_PER_INSTANCE)",
    501: "the agent does not open ports",
    502: "nothing listens on the port in the guest (connection-refused), or its answer is not HTTP",
    503: "the instance's agent is not connected",
    504: "the port did not answer in time",
}


def _same_origin(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    return not origin or urlsplit(origin).netloc == request.host


async def _target(call: Call[Any, Any], who: Principal) -> tuple[PortsService, Target, int]:
    row = await instance_to_change(services(call.request).db, who, call.match["instance_id"])
    port = check_port(call.match["port"])  # after the owner check: a stranger learns nothing
    service = call.app[PORTS_KEY]
    t = service.target(
        instance_id=row.id, incarnation=row.incarnation, owner=row.owner, actor=who.actor
    )
    return service, t, port


async def proxy(call: Call[Any, Any]) -> web.StreamResponse:
    """The request goes to `http://localhost:PORT/{path…}` in the guest (query kept; the
    server's credentials are never forwarded); the answer comes back as it is streamed, with
    `Content-Security-Policy: sandbox …` (the page runs in an opaque origin). A WebSocket
    upgrade is relayed as raw bytes once the guest answers 101."""
    who = call.require_principal()
    request = call.request
    websocket = is_websocket(request)
    if websocket and who.kind == "cookie" and not _same_origin(request):
        raise ProblemError(403, "cross-origin WebSocket with a cookie", code="bad-origin")
    service, t, port = await _target(call, who)
    prefix = BASE.format(instance_id=t.instance_id, port=port)
    what = f"{request.method} /{request.match_info.get('path', '')}"
    with service.slot(t.instance_id), services(request).streams.open(who, "port") as lease:
        stream = await service.open(t, port, "websocket" if websocket else "http", what)
        lease.on_revoke(lambda reason: stream.cancel("canceled", f"credential revoked: {reason}"))
        try:
            return await forward(request, stream, port, prefix)
        finally:
            stream.cancel("canceled", "the request ended")


async def to_slash(call: Call[Any, Any]) -> web.StreamResponse:
    """`…/ports/{port}` without a path: GET and HEAD are sent to `…/ports/{port}/` (a page's
    relative links need the slash); other methods go to the port's `/`."""
    if call.request.method in ("GET", "HEAD") and not is_websocket(call.request):
        who = call.require_principal()
        await _target(call, who)  # the same refusals as the proxy's, before any redirect
        query = call.request.query_string
        raise web.HTTPPermanentRedirect(call.request.path + "/" + ("?" + query if query else ""))
    return await proxy(call)


def _named(fn: Handler, name: str) -> Handler:
    """`fn` under its own name (each method's operation has its own id)."""

    @functools.wraps(fn)
    async def handler(call: Call[Any, Any]) -> web.StreamResponse:
        return await fn(call)

    handler.__name__ = handler.__qualname__ = name
    return handler


for _method in METHODS:
    api.route(
        _method,
        BASE + "/{path:.*}",
        role=Role.operator,
        summary="Reach an HTTP server on a port in the instance (reverse proxy)",
        tag="ports",
        content_type="application/octet-stream",
        responses=ERRORS,
    )(_named(proxy, f"proxy_{_method.lower()}"))
    api.route(
        _method,
        BASE,
        role=Role.operator,
        summary="The port's root (GET/HEAD: a redirect to …/ports/{port}/)",
        tag="ports",
        content_type="application/octet-stream",
        responses={**ERRORS, 308: "to the path with a trailing slash"},
    )(_named(to_slash, f"root_{_method.lower()}"))


@api.get(
    TUNNEL,
    websocket=True,
    role=Role.operator,
    summary="A raw TCP tunnel to a port in the instance (WebSocket, subprotocol sandbox.tcp.v1)",
    description=(
        "One TCP connection to 127.0.0.1:PORT in the guest per WebSocket. Binary frames carry "
        "its bytes both ways; a text frame `eof` ends one direction (a TCP half-close); the "
        "WebSocket closes (1000) when the connection ends, or with 1011 and the reason when "
        "the stream failed. Refusals (connection-refused, bad-port, limits) are problem+json "
        "answers before the upgrade. Authenticate with `bearer.<token>` or the cookie."
    ),
    tag="ports",
    responses={
        **ERRORS,
        400: "not a WebSocket upgrade, or the sandbox.tcp.v1 subprotocol is missing",
    },
)
async def tunnel(call: Call[Any, Any]) -> web.StreamResponse:
    try:
        return await _tunnel(call)
    except ProblemError as exc:
        # a WebSocket client never reads a refusal's body: the code and detail go as headers too
        exc.headers.setdefault("X-Problem-Code", exc.code)
        exc.headers.setdefault("X-Problem-Detail", _header_safe(exc.detail))
        raise


def _header_safe(text: str) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:300]


async def _tunnel(call: Call[Any, Any]) -> web.StreamResponse:
    who = call.require_principal()
    request = call.request
    if who.kind == "cookie" and not _same_origin(request):
        raise ProblemError(403, "cross-origin WebSocket with a cookie", code="bad-origin")
    ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), compress=False, max_msg_size=1 << 20)
    ready = ws.can_prepare(request)
    if not ready.ok:
        raise ProblemError(400, "this route needs a WebSocket upgrade", code="websocket-required")
    if ready.protocol != SUBPROTOCOL:
        raise ProblemError(
            400, f"offer the WebSocket subprotocol {SUBPROTOCOL}", code="subprotocol-required"
        )
    service, t, port = await _target(call, who)
    with service.slot(t.instance_id), services(request).streams.open(who, "port") as lease:
        stream = await service.open(t, port, "tunnel")
        lease.on_revoke(lambda reason: stream.cancel("canceled", f"credential revoked: {reason}"))
        try:
            await ws.prepare(request)
            await relay(ws, stream)
        finally:
            stream.cancel("canceled", "the tunnel ended")
    return ws
