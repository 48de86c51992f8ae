"""Ports in an instance: a raw TCP tunnel, and port forwarding from this machine's loopback.

    async with await client.instances.tunnel(instance_id, 8000) as t:   # one TCP connection
        await t.write(b"GET / HTTP/1.0\\r\\n\\r\\n"); await t.write_eof()
        while data := await t.read(): ...

    async with await client.instances.port_forward(instance_id, 8000, local_port=0) as fwd:
        fwd.address                                   # ("127.0.0.1", 43121): connect there
        await fwd.serve_forever()                     # or just keep it open

Each tunnel is the server's `…/instances/{id}/tunnels/{port}` WebSocket (`sandbox.tcp.v1`:
binary frames are the bytes, a text frame `eof` ends a direction), one TCP connection to
127.0.0.1:PORT inside the instance over its agent link (so it works in `isolated` guests). A
forward listens on 127.0.0.1 only and opens one tunnel per accepted connection. Refusals are
the SDK's `ApiError`s with the server's code (`connection-refused`, `bad-port`,
`too-many-port-streams`, …). The HTTP reverse proxy needs no SDK: its URL is `proxy_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping

import aiohttp

from agentic_sandbox.sdk.errors import ApiError, ConnectionFailed, from_response
from agentic_sandbox.sdk.transport import Transport

SUBPROTOCOL = "sandbox.tcp.v1"
EOF_TEXT = "eof"
READ = 64 * 1024
CLOSE_WAIT = 3.0  # seconds a closing tunnel or listener is waited for
log = logging.getLogger(__name__)


def tunnel_path(instance_id: str, port: int) -> str:
    return f"/api/v2/admin/instances/{instance_id}/tunnels/{port}"


def proxy_path(instance_id: str, port: int, path: str = "/") -> str:
    return f"/api/v2/admin/instances/{instance_id}/ports/{port}/" + path.lstrip("/")


def _refusal(exc: aiohttp.WSServerHandshakeError) -> ApiError:
    """A refused upgrade as the server's problem (its code and detail come as headers: a
    WebSocket client never sees the refusal's body)."""
    headers: Mapping[str, str] = exc.headers or {}
    doc = {
        "status": exc.status,
        "code": headers.get("X-Problem-Code", ""),
        "detail": headers.get("X-Problem-Detail", "") or exc.message,
    }
    return from_response(exc.status, json.dumps(doc).encode(), headers.get("Retry-After"))


class Tunnel:
    """One TCP connection to a port in the instance."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, instance_id: str, port: int) -> None:
        self._ws = ws
        self.instance_id = instance_id
        self.port = port
        self.eof = False  # the guest ended its direction (or the tunnel closed)
        self.error = ""  # why the server closed the tunnel, when it failed

    @classmethod
    async def open(cls, t: Transport, instance_id: str, port: int) -> Tunnel:
        protocols = [SUBPROTOCOL]
        if t.token:
            protocols.append(f"bearer.{t.token}")
        await t.resolve_leader()  # a WebSocket cannot follow a follower's 307
        try:
            ws = await t.session.ws_connect(
                t.ws_url + tunnel_path(instance_id, port),
                protocols=protocols,
                compress=0,
                heartbeat=30,
                max_msg_size=0,
            )
        except aiohttp.WSServerHandshakeError as exc:
            raise _refusal(exc) from None
        except (aiohttp.ClientConnectionError, OSError) as exc:
            t.forget_leader()
            raise ConnectionFailed(f"cannot open a tunnel to port {port}: {exc}") from None
        return cls(ws, instance_id, port)

    async def read(self) -> bytes:
        """The next bytes from the port; b"" once the guest ended its direction."""
        while not self.eof:
            msg = await self._ws.receive()
            if msg.type == aiohttp.WSMsgType.BINARY:
                return bytes(msg.data)
            if msg.type == aiohttp.WSMsgType.TEXT and msg.data == EOF_TEXT:
                self.eof = True
            elif msg.type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSING,
                aiohttp.WSMsgType.CLOSED,
                aiohttp.WSMsgType.ERROR,
            ):
                self.eof = True
                code = self._ws.close_code
                if code not in (None, 1000):
                    self.error = str(msg.extra or "") or f"closed with {code}"
        return b""

    async def write(self, data: bytes) -> None:
        await self._ws.send_bytes(data)

    async def write_eof(self) -> None:
        """End this direction (a TCP half-close): the port reads EOF."""
        await self._ws.send_str(EOF_TEXT)

    async def close(self) -> None:
        """Close the tunnel; a server that does not answer the close handshake within
        `CLOSE_WAIT` seconds is not waited for (the connection is dropped)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT):
                await self._ws.close()

    @property
    def closed(self) -> bool:
        return self._ws.closed

    async def __aenter__(self) -> Tunnel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class PortForward:
    """A listener on 127.0.0.1 whose every connection is tunnelled to the instance's port."""

    def __init__(self, t: Transport, instance_id: str, port: int) -> None:
        self._t = t
        self.instance_id = instance_id
        self.port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0  # accepted so far
        self.failures: list[str] = []  # why tunnels could not be opened (the last few)

    async def start(self, local_port: int = 0) -> PortForward:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", local_port)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "start() it first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The connection's work runs in a task of its own, the one `close()` cancels: Python
        # 3.11's start_server logs the cancellation of its callback's task as an error.
        self.connections += 1
        work = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(work)
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            self._tasks.discard(work)
        if not work.cancelled() and (exc := work.exception()) is not None:
            log.warning("port %d: a forwarded connection failed: %r", self.port, exc)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                tunnel = await Tunnel.open(self._t, self.instance_id, self.port)
            except (ApiError, ConnectionFailed) as exc:
                self.failures = [*self.failures[-9:], str(exc)]
                log.warning("port %d: %s", self.port, exc)
                return
            async with tunnel:
                await _splice(reader, writer, tunnel)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def serve_forever(self) -> None:
        assert self._server is not None, "start() it first"
        await self._server.serve_forever()

    async def close(self) -> None:
        """Stop listening and end every tunnel, all at once (never one close handshake after
        another), within `CLOSE_WAIT` seconds."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT)
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT):
                    await self._server.wait_closed()

    async def __aenter__(self) -> PortForward:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _splice(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tunnel: Tunnel
) -> None:
    async def up() -> None:
        while data := await reader.read(READ):
            await tunnel.write(data)
        await tunnel.write_eof()

    async def down() -> None:
        while data := await tunnel.read():
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not tunnel.error:
            writer.write_eof()

    ups, downs = asyncio.ensure_future(up()), asyncio.ensure_future(down())
    try:
        # the tunnel ends when the guest's side is done; the local side's end only half-closes
        await downs
    except (ConnectionError, aiohttp.ClientError):
        pass
    finally:
        ups.cancel()
        with contextlib.suppress(BaseException):
            await ups
