"""A raw TCP tunnel over a WebSocket (subprotocol `sandbox.tcp.v1`): one port stream each.

Binary frames carry the connection's bytes both ways; a text frame `eof` ends one direction
(the caller's: the port's channel 0 ends; the guest's: the caller is sent `eof`). The
WebSocket closes 1000 when the stream ends cleanly, 1011 with the reason when it failed.
Backpressure both ways: a frame from the caller is written to the stream under its credit
before the next is read; the guest's bytes are credited back only as the WebSocket takes them.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import WSCloseCode, WSMsgType, web

from agentic_sandbox.broker.agentlink import ServerStream, StreamError
from agentic_sandbox.broker.ports.service import FROM_PORT, TO_PORT

SUBPROTOCOL = "sandbox.tcp.v1"
EOF_TEXT = "eof"
FRAME = 64 * 1024


async def _caller_to_port(ws: web.WebSocketResponse, stream: ServerStream) -> None:
    async for msg in ws:
        if msg.type == WSMsgType.BINARY:
            await stream.write(TO_PORT, msg.data, chunk=FRAME)
        elif msg.type == WSMsgType.TEXT and msg.data == EOF_TEXT:
            await stream.end(TO_PORT)
        elif msg.type in (WSMsgType.ERROR, WSMsgType.CLOSE):
            break


async def _port_to_caller(ws: web.WebSocketResponse, stream: ServerStream) -> str:
    """Send what the guest sends until the stream ends; returns why it failed ("" if not)."""
    while (chunk := await stream.read()) is not None:
        if chunk.channel != FROM_PORT:
            continue
        if chunk.data:
            await ws.send_bytes(chunk.data)
        if chunk.eof:
            await ws.send_str(EOF_TEXT)
    if stream.failure is not None:
        return stream.failure.message
    try:
        await stream.result()
    except StreamError as exc:
        return f"{exc.code}: {exc.message}"
    return ""


async def relay(ws: web.WebSocketResponse, stream: ServerStream) -> None:
    """Relay until the stream ends or the caller goes away, whichever first."""
    up = asyncio.ensure_future(_caller_to_port(ws, stream))
    down = asyncio.ensure_future(_port_to_caller(ws, stream))
    error = ""
    try:
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if down.done() and not down.cancelled() and down.exception() is None:
            error = down.result()
    finally:
        for task in (up, down):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        stream.cancel("canceled", "the tunnel ended")
        with contextlib.suppress(ConnectionError, RuntimeError):
            if error:
                await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=error[:120].encode())
            else:
                await ws.close()
