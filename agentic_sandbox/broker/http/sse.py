"""Server-Sent Events: the one writer behind every SSE stream the server serves (the event
stream, A2A streaming and subscriptions, the v1 task logs).

    stream = await EventStream.open(request, principal)   # lease, prepare, `retry:`
    try:
        async for item in stream.follow(source):          # keepalives while idle
            await stream.send(json.dumps(item), event="x")
        if stream.revoked:                                # the credential was revoked
            await stream.send(..., event="revoked")
    finally:
        await stream.close()

The stream is leased under the caller's credentials (`LiveStreams`): revoking the credential
ends `follow` at once, whatever the source is doing. An idle source never ends the stream: the
pending read is kept across keepalives (never cancelled by a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

from aiohttp import web

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.auth.streams import StreamLease
from agentic_sandbox.broker.services import services

T = TypeVar("T")

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class EventStream:
    def __init__(self, response: web.StreamResponse, lease: StreamLease, keepalive: float) -> None:
        self.response = response
        self.lease = lease
        self.keepalive = keepalive
        self._followers: list[AsyncGenerator[object, None]] = []

    @classmethod
    async def open(
        cls, request: web.Request, principal: Principal, *, retry_ms: int | None = 2000
    ) -> EventStream:
        """Lease (raises `TooManyStreams`), then prepare the response."""
        svc = services(request)
        lease = svc.streams.open(principal, "sse")
        response = web.StreamResponse(headers=HEADERS)
        try:
            await response.prepare(request)
            if retry_ms is not None:
                await response.write(f"retry: {retry_ms}\n\n".encode())
        except BaseException:
            lease.release()
            raise
        return cls(response, lease, svc.settings.sse_keepalive_seconds)

    @property
    def revoked(self) -> bool:
        return self.lease.revoked.is_set()

    @property
    def reason(self) -> str:
        return self.lease.reason

    async def send(self, data: str, *, event: str | None = None, id: str | None = None) -> None:
        head = (f"id: {id}\n" if id is not None else "") + (f"event: {event}\n" if event else "")
        body = data if "\n" not in data else data.replace("\n", "\ndata: ")
        await self.response.write(f"{head}data: {body}\n\n".encode())

    async def comment(self, text: str) -> None:
        await self.response.write(f": {text}\n\n".encode())

    def follow(self, source: AsyncIterator[T]) -> AsyncIterator[T]:
        """The source's items until it ends or the credential is revoked."""
        gen = self._follow(source)
        self._followers.append(gen)
        return gen

    async def _follow(self, source: AsyncIterator[T]) -> AsyncGenerator[T, None]:
        it = source.__aiter__()
        revoked: asyncio.Future[Any] = asyncio.ensure_future(self.lease.revoked.wait())
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(_next(it))
                done, _ = await asyncio.wait(
                    {pending, revoked}, timeout=self.keepalive, return_when=asyncio.FIRST_COMPLETED
                )
                if revoked in done:
                    return
                if pending not in done:
                    await self.comment("keepalive")
                    continue
                fut, pending = pending, None
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            revoked.cancel()
            if pending is not None:
                # Let the cancelled read finish, so the source can be closed right after.
                pending.cancel()
                await asyncio.wait({pending})

    async def close(self) -> None:
        """Stop following, release the lease and end the response (errors of a gone client
        are ignored)."""
        for gen in self._followers:
            await gen.aclose()
        self._followers.clear()
        self.lease.release()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.response.write_eof()


async def _next(it: AsyncIterator[T]) -> T:
    return await it.__anext__()
