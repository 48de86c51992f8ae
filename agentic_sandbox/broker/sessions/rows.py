"""Write-behind of session rows: state changes, sizes and output offsets, never on the output
path.

`persist(session_id, **values)` only records the values (merged per session, newer values
win: what is pending is bounded by the number of sessions) and wakes one background writer,
which writes them in order in one transaction per batch. A failed batch is kept (values that
arrived meanwhile still win) and retried a second later. `flush()` writes what is pending now
(the hub calls it when it stops).

The face is these two calls (plus `start`/`stop` of the writer), so the writer can be swapped
for a shared batch writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

from sqlalchemy import update

from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


class SessionRows:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._pending: dict[str, dict[str, object]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def persist(self, session_id: str, **values: object) -> None:
        """Write these column values of the session's row soon (in order, merged)."""
        self._pending.setdefault(session_id, {}).update(values)
        self._wake.set()

    async def flush(self) -> None:
        """Write everything pending now."""
        while self._pending:
            batch, self._pending = self._pending, {}
            now = dt.datetime.now(dt.UTC)
            try:
                async with self._db.session() as s:
                    for sid, values in batch.items():
                        await s.execute(
                            update(m.Session)
                            .where(m.Session.id == sid)
                            .values(**values, updated_at=now)
                        )
            except BaseException:
                for sid, values in batch.items():  # keep them, newer values win
                    self._pending[sid] = {**values, **self._pending.get(sid, {})}
                raise

    def start(self) -> None:
        self._task = asyncio.create_task(self._writer(), name="session-db-writer")

    async def stop(self) -> None:
        """Write what is pending (a failure is logged), then stop the writer."""
        try:
            await self.flush()
        except Exception:
            log.exception("writing session state at shutdown failed")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("writing session state failed; retrying")
                await asyncio.sleep(RETRY_SECONDS)
                self._wake.set()
