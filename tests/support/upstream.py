"""A small HTTP + WebSocket server on a loopback port, in a thread of its own: what a guest's
dev server plays in the ports tests (next to a host agent, which reaches it on 127.0.0.1).

    with Upstream() as up:
        up.port                  # GET /hello, /headers (the request's headers as JSON),
                                 # /bytes?n=N (N bytes, streamed), POST /echo (the body back),
                                 # /ws (a WebSocket echo)
        up.eof_port              # raw TCP: reads until the peer's half-close, then answers
                                 # b"got N bytes" and closes (aiohttp's server, like many,
                                 # drops an answer when the request and the EOF come together)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from aiohttp import WSMsgType, web

CHUNK = 256 * 1024
MAX_BYTES = 1024**3  # the longest /bytes answer (a bounded flood)


async def _hello(request: web.Request) -> web.Response:
    return web.Response(text=f"hello from {request.raw_path}")


async def _headers(request: web.Request) -> web.Response:
    return web.json_response({k.lower(): v for k, v in request.headers.items()})


async def _echo(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.content_type = "application/octet-stream"
    await resp.prepare(request)
    while data := await request.content.readany():
        await resp.write(data)
    await resp.write_eof()
    return resp


async def _bytes(request: web.Request) -> web.StreamResponse:
    n = min(int(request.query.get("n", "0")), MAX_BYTES)
    resp = web.StreamResponse(headers={"Content-Length": str(n)})
    resp.content_type = "application/octet-stream"
    await resp.prepare(request)
    block = b"x" * CHUNK
    left = n
    while left > 0:
        part = block[: min(left, CHUNK)]
        await resp.write(part)
        left -= len(part)
    await resp.write_eof()
    return resp


async def _ws(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(protocols=("echo.v1",))
    await ws.prepare(request)
    async for msg in ws:
        if msg.type == WSMsgType.TEXT:
            await ws.send_str(msg.data)
        elif msg.type == WSMsgType.BINARY:
            await ws.send_bytes(msg.data)
    return ws


async def _answer_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    got = 0
    while data := await reader.read(CHUNK):
        got += len(data)
    writer.write(f"got {got} bytes".encode())
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


class Upstream:
    def __init__(self) -> None:
        self.port = 0
        self.eof_port = 0
        self._eof_server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> Upstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        app = web.Application(client_max_size=MAX_BYTES)
        app.router.add_get("/hello", _hello)
        app.router.add_get("/sub/{tail:.*}", _hello)
        app.router.add_get("/headers", _headers)
        app.router.add_post("/echo", _echo)
        app.router.add_get("/bytes", _bytes)
        app.router.add_get("/ws", _ws)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server
        self.port = int(server.sockets[0].getsockname()[1])
        self._eof_server = await asyncio.start_server(_answer_after_eof, "127.0.0.1", 0)
        self.eof_port = int(self._eof_server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        if self._eof_server is not None:
            self._eof_server.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
