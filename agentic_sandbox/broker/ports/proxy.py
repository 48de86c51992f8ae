"""The reverse proxy: one HTTP request (or one WebSocket) to a guest port per port stream.

`/api/v2/admin/instances/{id}/ports/{port}/{path…}` goes to `http://localhost:PORT/{path…}` in
the guest, through one stream (`service.py`): the request is written with h11 (client side) on
channel 0 while its body is read as it comes, the answer is read with h11 from channel 1 and
streamed to the caller as it comes (credit goes back only as the caller takes it). Nothing is
parsed by hand.

What the guest never gets: the server's credentials — `Authorization`, the dashboard cookie,
`X-CSRF-Token`, a `bearer.*` WebSocket subprotocol — and hop-by-hop headers. It gets
`Host: localhost:PORT` and `X-Forwarded-For/-Proto/-Host/-Prefix`.

What the caller never gets from the guest: a `Set-Cookie` for the dashboard's cookie, and
hop-by-hop headers. Every answer carries `Content-Security-Policy: sandbox …` (without
`allow-same-origin`): a guest's page runs in an opaque origin, so its scripts cannot use the
operator's cookie on the admin API that shares this origin.

A WebSocket upgrade is forwarded as an HTTP request too; once the guest answers 101, the
caller gets that 101 and the connection carries raw bytes both ways (as nginx does): the
caller's bytes are taken with the server protocol's `set_parser` hook (the one aiohttp's own
WebSocketResponse uses), the guest's are written to the caller's transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import h11
from aiohttp import web

from agentic_sandbox.broker.agentlink import ServerStream, StreamError
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.ports.service import FROM_PORT, TO_PORT

log = logging.getLogger(__name__)

RESPONSE_TIMEOUT = 120.0  # from the request's end to the answer's headers
FRAME = 64 * 1024
SESSION_COOKIE = "sbx_session"  # the dashboard's cookie (auth.routes): never forwarded
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "http2-settings",
    }
)
NOT_FORWARDED = HOP_BY_HOP | {
    "host",
    "expect",  # the server answers 100-continue itself
    "authorization",
    "x-csrf-token",
    "content-length",
    "cookie",
    "sec-websocket-protocol",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-prefix",
}
SANDBOX_CSP = "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"
WS_HEADERS = ("sec-websocket-accept", "sec-websocket-protocol", "sec-websocket-extensions")


def is_websocket(request: web.Request) -> bool:
    conn = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return "upgrade" in conn and request.headers.get("Upgrade", "").lower() == "websocket"


def _connection_tokens(value: str) -> set[str]:
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def _cookies_without_ours(header: str) -> str:
    kept = [
        part.strip()
        for part in header.split(";")
        if part.strip() and part.split("=", 1)[0].strip() != SESSION_COOKIE
    ]
    return "; ".join(kept)


def upstream_headers(
    request: web.Request, port: int, prefix: str, websocket: bool
) -> list[tuple[str, str]]:
    """The request's headers as the guest gets them (see the module's docstring)."""
    extra = _connection_tokens(request.headers.get("Connection", ""))
    out: list[tuple[str, str]] = [("host", f"localhost:{port}")]
    for name, value in request.headers.items():
        low = name.lower()
        if low in NOT_FORWARDED or low in extra:
            continue
        out.append((name, value))
    cookie = _cookies_without_ours("; ".join(request.headers.getall("Cookie", [])))
    if cookie:
        out.append(("cookie", cookie))
    if websocket:
        out += [("connection", "Upgrade"), ("upgrade", "websocket")]
        protocols = [
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip() and not p.strip().startswith("bearer.")
        ]
        if protocols:
            out.append(("sec-websocket-protocol", ", ".join(protocols)))
    else:
        out.append(("connection", "close"))
    out += [
        ("x-forwarded-for", request.remote or ""),
        ("x-forwarded-proto", request.scheme),
        ("x-forwarded-host", request.host),
        ("x-forwarded-prefix", prefix),
    ]
    return out


def upstream_target(request: web.Request) -> str:
    """`/{path…}?query` after `/api/v2/admin/instances/{id}/ports/{port}` (raw, as sent)."""
    raw_path, sep, query = request.raw_path.partition("?")
    parts = raw_path.split("/")  # '', api, v2, admin, instances, id, ports, port, …
    target = "/" + "/".join(parts[8:])
    return target + (sep + query if sep else "")


def downstream_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    items = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers]
    extra: set[str] = set()
    for n, v in items:
        if n.lower() == "connection":
            extra |= _connection_tokens(v)
    out: list[tuple[str, str]] = []
    for n, v in items:
        low = n.lower()
        if low in HOP_BY_HOP or low in extra or low == "content-security-policy":
            continue
        if low == "set-cookie" and v.split("=", 1)[0].strip() == SESSION_COOKIE:
            continue
        out.append((n, v))
    out.append(("Content-Security-Policy", SANDBOX_CSP))
    return out


class Upstream:
    """h11's client side over one port stream."""

    def __init__(self, stream: ServerStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self._eof = False

    async def send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.write(TO_PORT, data, chunk=FRAME)

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            if self._eof:
                raise h11.RemoteProtocolError("the guest closed the connection mid-answer")
            chunk = await self.stream.read()
            if chunk is None or (chunk.channel == FROM_PORT and chunk.eof):
                if chunk is not None and chunk.data:
                    self.h11.receive_data(chunk.data)
                self._eof = True
                self.h11.receive_data(b"")
            elif chunk.channel == FROM_PORT:
                self.h11.receive_data(chunk.data)


async def _send_body(up: Upstream, request: web.Request, has_body: bool) -> None:
    if has_body:
        while data := await request.content.readany():
            await up.send(h11.Data(data=data))
    await up.send(h11.EndOfMessage())


def _gateway(port: int, message: str, code: str = "bad-gateway") -> ProblemError:
    return ProblemError(502, f"port {port}: {message}", code=code, extra={"port": port})


async def forward(
    request: web.Request, stream: ServerStream, port: int, prefix: str
) -> web.StreamResponse:
    """Forward `request` over `stream` (connected to the port) and stream the answer back."""
    websocket = is_websocket(request)
    headers = upstream_headers(request, port, prefix, websocket)
    has_body = not websocket and request.body_exists
    if has_body:
        if request.content_length is not None:
            headers.append(("content-length", str(request.content_length)))
        else:
            headers.append(("transfer-encoding", "chunked"))
    up = Upstream(stream)
    loop = asyncio.get_running_loop()
    try:
        await up.send(
            h11.Request(method=request.method, target=upstream_target(request), headers=headers)
        )
    except h11.LocalProtocolError as exc:
        raise ProblemError(
            400, f"the request cannot be forwarded: {exc}", code="bad-request"
        ) from None
    except StreamError as exc:
        raise _gateway(port, f"the stream ended: {exc.message}", "agent-link-lost") from None
    body = asyncio.ensure_future(_send_body(up, request, has_body))
    body.add_done_callback(_consume)
    stream.expire_at(loop.time() + RESPONSE_TIMEOUT, "the guest did not answer in time")
    try:
        while True:
            event = await up.next_event()
            if isinstance(event, h11.InformationalResponse):
                if event.status_code == 101 and websocket:
                    return await _switch(request, up, event, port)
                continue
            if isinstance(event, h11.Response):
                break
            raise _gateway(port, "the guest's answer is not HTTP")
    except h11.RemoteProtocolError as exc:
        body.cancel()
        if stream.failure is not None and stream.failure.code == "timeout":
            raise ProblemError(
                504, f"port {port}: the guest did not answer in time", code="port-timeout"
            ) from None
        raise _gateway(port, f"the guest's answer is not HTTP: {exc}") from None
    stream.expire_at(None)
    resp = web.StreamResponse(
        status=event.status_code, reason=event.reason.decode("latin-1") or None
    )
    for name, value in downstream_headers(event.headers):
        resp.headers.add(name, value)
    try:
        await resp.prepare(request)
        while True:
            ev = await up.next_event()
            if isinstance(ev, h11.Data):
                await resp.write(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                break
        await resp.write_eof()
    except (h11.RemoteProtocolError, ConnectionError, RuntimeError) as exc:
        # after the headers a failure can only break the answer off (a clean end would pass
        # a partial answer for a whole one)
        log.info("port %d: the answer was broken off: %s", port, exc)
        if request.transport is not None:
            request.transport.close()
    finally:
        body.cancel()
    return resp


def _consume(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


class _CallerBytes:
    """The caller's side after a 101: what the server protocol hands `set_parser`'s parser.
    Reading from the caller pauses while `PAUSE_AT` reads wait for the stream's credit."""

    PAUSE_AT, RESUME_AT, MAX = 16, 4, 64

    def __init__(self, transport: asyncio.Transport) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=self.MAX)
        self._transport = transport
        self._paused = False

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if data:
            try:
                self.queue.put_nowait(bytes(data))
            except asyncio.QueueFull:  # past the pause: a transport that ignores it
                self._transport.close()
            if self.queue.qsize() >= self.PAUSE_AT and not self._paused:
                self._paused = True
                self._transport.pause_reading()
        return False, b""

    async def get(self) -> bytes | None:
        data = await self.queue.get()
        if self._paused and self.queue.qsize() <= self.RESUME_AT:
            self._paused = False
            self._transport.resume_reading()
        return data

    def feed_eof(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)


async def _switch(
    request: web.Request, up: Upstream, event: h11.InformationalResponse, port: int
) -> web.StreamResponse:
    """The guest switched protocols: answer the caller's upgrade and relay raw bytes."""
    stream = up.stream
    stream.expire_at(None)
    trailing, _ = up.h11.trailing_data
    resp = web.StreamResponse(status=101, reason="Switching Protocols")
    resp.headers["Upgrade"] = "websocket"
    resp.headers["Connection"] = "Upgrade"
    for name, value in event.headers:
        low = name.decode("latin-1").lower()
        if low in WS_HEADERS:
            resp.headers[low] = value.decode("latin-1")
    await resp.prepare(request)
    transport = request.transport
    protocol = request.protocol
    if transport is None:
        stream.cancel("canceled", "the caller went away")
        return resp
    caller = _CallerBytes(transport)
    protocol.set_parser(caller)  # type: ignore[arg-type]
    if trailing:
        transport.write(trailing)

    async def up_pump() -> None:
        while (data := await caller.get()) is not None:
            await stream.write(TO_PORT, data, chunk=FRAME)
        with contextlib.suppress(StreamError):
            await stream.end(TO_PORT)

    pump = asyncio.ensure_future(up_pump())
    pump.add_done_callback(_consume)
    try:
        while (chunk := await stream.read()) is not None:
            if chunk.channel != FROM_PORT:
                continue
            if chunk.data:
                transport.write(chunk.data)
                await request.writer.drain()
            if chunk.eof:
                break
    except (ConnectionError, RuntimeError):
        pass
    finally:
        pump.cancel()
        stream.cancel("canceled", "the WebSocket ended")
        transport.close()
    return resp
