"""A follower's tail of the leader's event log: `LISTEN sandbox_events` plus a poll.

The leader's event writer sends `NOTIFY sandbox_events` in each commit of events
(`SqlEventLog.append`). The tail waits for that notification, or `poll_seconds` at most (a
notification can be missed while its connection is down), and then calls `pull()`, which
reads the log after the bus's `last_seq` and brings those events to this node's ring and live
subscribers (`EventBus.pull`). So an SSE stream on a follower carries the leader's events, and
it goes on through a failover: on promotion the server stops the tail, and `EventBus.lead()`
pulls once more before it continues the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import NullPool

from agentic_sandbox.broker.store import Database

log = logging.getLogger(__name__)

CHANNEL = "sandbox_events"  # the same name as eventlog.NOTIFY_CHANNEL


class EventTail:
    def __init__(
        self,
        db: Database,
        pull: Callable[[], Awaitable[int]],
        *,
        node: str,
        poll_seconds: float = 0.5,
    ) -> None:
        self._pull = pull
        self._poll = poll_seconds
        # Its own connection: a LISTEN belongs to one connection, which the pool must not
        # hand to anyone else.
        self._engine = create_async_engine(
            db.url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={"server_settings": {"application_name": f"sandbox-tail:{node}"[:63]}},
        )
        self._conn: AsyncConnection | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._complained = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-tail")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._unlisten()
        await self._engine.dispose()

    def _notified(self, *_: Any) -> None:
        self._wake.set()

    async def _listen(self) -> None:
        conn = await self._engine.connect()
        try:
            raw = await conn.get_raw_connection()
            await raw.driver_connection.add_listener(CHANNEL, self._notified)  # type: ignore[union-attr]
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def _unlisten(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    def _listening(self) -> bool:
        if self._conn is None:
            return False
        try:
            raw = self._conn.sync_connection.connection.driver_connection  # type: ignore[union-attr]
            return not raw.is_closed()  # type: ignore[union-attr]
        except Exception:
            return False

    async def _run(self) -> None:
        while True:
            if not self._listening():
                await self._unlisten()
                try:
                    await self._listen()
                    self._complained = False
                except Exception as exc:  # the poll carries on without notifications
                    if not self._complained:
                        log.warning("event tail: LISTEN failed (%s); polling only", exc)
                        self._complained = True
            self._wake.clear()
            try:
                await self._pull()
            except Exception:
                log.warning("event tail: reading the log failed; retrying", exc_info=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll):
                    await self._wake.wait()
