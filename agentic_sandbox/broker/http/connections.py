"""HTTP connections: how long one may idle, how many one address may hold.

- **Idle / header timeout**: aiohttp's `keepalive_timeout` (`http_idle_timeout_seconds`) starts
  when a connection opens and again after each response; a connection that has not sent a
  complete request head by then is closed. It does not run while a handler works, so a
  WebSocket or an SSE stream in progress is never cut by it.
- **Body timeout**: see `http/body.py` (`http_body_timeout_seconds`). The same bound limits
  aiohttp's "lingering close" (reading and discarding a body left unread after the answer,
  10 s by default), so a stalled body frees its connection within twice that time.
- **Per-address cap**: `ConnectionCap` counts open connections by remote address on one
  aiohttp server; past `http_max_connections_per_address` a new connection is answered `429`
  (with `Retry-After`) and closed before its request is read. At most `MAX_ADDRESSES` addresses
  are tracked at once; a connection from yet another address is refused the same way.

The cap hooks the low-level server's `connection_made`/`connection_lost` (the calls every
aiohttp `RequestHandler` makes on its manager), so it sees each connection once, before any
byte of it is parsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TypedDict

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from agentic_sandbox.broker.config import Settings

log = logging.getLogger(__name__)

MAX_ADDRESSES = 10_000
RETRY_AFTER_SECONDS = 5
LOG_EVERY_SECONDS = 10.0


class HttpTimeouts(TypedDict):
    keepalive_timeout: float
    lingering_time: float


def http_timeouts(settings: Settings) -> HttpTimeouts:
    """aiohttp `RequestHandler` settings for a runner."""
    return {
        "keepalive_timeout": settings.http_idle_timeout_seconds,
        "lingering_time": min(10.0, settings.http_body_timeout_seconds),
    }


def _refusal(limit: int) -> bytes:
    body = json.dumps(
        {
            "type": "https://agentic-sandbox.dev/problems/too-many-connections",
            "title": "Too Many Requests",
            "status": 429,
            "detail": f"this address already holds {limit} open connections (the maximum)",
            "code": "too-many-connections",
        }
    ).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\n"
        "Content-Type: application/problem+json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {RETRY_AFTER_SECONDS}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


class ConnectionCap:
    def __init__(self, per_address: int, *, max_addresses: int = MAX_ADDRESSES) -> None:
        self.per_address = per_address
        self.max_addresses = max_addresses
        self._open: dict[str, int] = {}
        self._counted: dict[RequestHandler, str] = {}  # handler -> its address
        self._answer = _refusal(per_address)
        self.refused = 0
        self._logged_at = 0.0

    def install(self, server: web.Server) -> None:
        made = server.connection_made
        lost = server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._admit(handler, transport)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            self._release(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def open_connections(self, address: str | None = None) -> int:
        if address is not None:
            return self._open.get(address, 0)
        return sum(self._open.values())

    def _admit(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        count = self._open.get(address, 0)
        if count >= self.per_address or (count == 0 and len(self._open) >= self.max_addresses):
            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY_SECONDS:
                self._logged_at = now
                log.warning(
                    "refusing HTTP connections from %s: %d open (limit %d); %d refused so far",
                    address,
                    count,
                    self.per_address,
                    self.refused,
                    extra={"remote": address},
                )
            transport.write(self._answer)
            transport.close()
            return
        self._open[address] = count + 1
        self._counted[handler] = address

    def _release(self, handler: RequestHandler) -> None:
        address = self._counted.pop(handler, None)
        if address is None:
            return
        left = self._open.get(address, 1) - 1
        if left > 0:
            self._open[address] = left
        else:
            self._open.pop(address, None)
