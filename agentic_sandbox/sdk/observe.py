"""Events (a cursor to page with, and a live stream that resumes where it broke) and the
audit log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from agentic_sandbox.sdk.errors import ApiError, ConnectionFailed, Unauthorized
from agentic_sandbox.sdk.models import AuditEntry, AuditPage, Event, EventPage
from agentic_sandbox.sdk.operations import ADMIN, Resource

EVENTS = "/api/v1/events"


def _types(types: str | Sequence[str] | None) -> str | None:
    if types is None or isinstance(types, str):
        return types
    return ",".join(types) or None


class AsyncEvents(Resource):
    async def page(
        self,
        *,
        after: int = 0,
        limit: int = 100,
        types: str | Sequence[str] | None = None,
        instance_id: str | None = None,
        session_id: str | None = None,
        task_id: str | None = None,
        host: str | None = None,
    ) -> EventPage:
        """Events with `seq > after`, oldest first (at most 200); read on from `page.next`.
        `types` are event types or families (`instance.*`)."""
        params = {
            "after": after,
            "limit": limit,
            "type": _types(types),
            "instance_id": instance_id,
            "session_id": session_id,
            "task_id": task_id,
            "host": host,
        }
        return await self._t.model(EventPage, "GET", EVENTS, params=params)

    async def iter(self, *, after: int = 0, **filters: Any) -> AsyncIterator[Event]:
        """Every stored event after `after` (page by page) up to the newest; then it ends."""
        while True:
            page = await self.page(after=after, limit=200, **filters)
            for ev in page.items:
                yield ev
            if not page.items or page.next <= after:
                return
            after = page.next

    async def follow(
        self,
        *,
        after: int | None = None,
        types: str | Sequence[str] | None = None,
        instance_id: str | None = None,
        session_id: str | None = None,
        task_id: str | None = None,
        host: str | None = None,
        reconnect_within: float = 60.0,
    ) -> AsyncIterator[Event]:
        """Live events (Server-Sent Events), after `after` (None: from the newest event when
        iteration begins — pass a seq to miss nothing of what you do before) and then as they
        happen, for as long as you iterate. A dropped stream is re-opened after the last seq
        seen, so nothing is missed or repeated; an event of type `stream.gap` says this client
        fell behind the server's buffer. A revoked token ends it with `Unauthorized`."""
        if after is None:
            after = (await self.page(limit=1, types=types)).last_seq
        params = {
            "type": _types(types),
            "instance_id": instance_id,
            "session_id": session_id,
            "task_id": task_id,
            "host": host,
        }
        last = after
        deadline = time.monotonic() + reconnect_within
        delay = 0.1
        while True:
            try:
                async for sse in self._t.sse(f"{EVENTS}/stream", {**params, "after": last}):
                    if sse.event == "revoked":
                        reason = sse.json().get("reason", "revoked")
                        raise Unauthorized(401, f"the event stream ended: {reason}")
                    ev = Event.model_validate(sse.json())
                    if sse.id is not None:
                        last = ev.seq
                    deadline, delay = time.monotonic() + reconnect_within, 0.1
                    yield ev
            except ConnectionFailed:
                pass
            except ApiError as exc:
                if exc.status < 500 and exc.status != 429:
                    raise
            if time.monotonic() + delay > deadline:
                raise ConnectionFailed(
                    f"the event stream broke after seq {last} and did not come back"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


class AsyncAudit(Resource):
    async def page(
        self,
        *,
        subject_type: str | None = None,
        subject_id: str | None = None,
        actor: str | None = None,
        outcome: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> AuditPage:
        """Audit entries with `id > after`; `outcome` is ok, denied or failed."""
        params = {
            "subject_type": subject_type,
            "subject_id": subject_id,
            "actor": actor,
            "outcome": outcome,
            "after": after,
            "limit": limit,
        }
        return await self._t.model(AuditPage, "GET", f"{ADMIN}/audit", params=params)

    async def iter(self, *, after: int = 0, **filters: Any) -> AsyncIterator[AuditEntry]:
        """Every matching entry after `after`, page by page."""
        while True:
            page = await self.page(after=after, limit=1000, **filters)
            for entry in page.items:
                yield entry
            if not page.items or page.next <= after:
                return
            after = page.next
