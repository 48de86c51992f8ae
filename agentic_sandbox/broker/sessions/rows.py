"""Write-behind of session rows: state changes, sizes and output offsets, never on the output
path.

`persist(session_id, **values)` hands the values to the server's one write-behind loop
(`store/batch.py`'s `BatchWriter`): values for a session that still waits are merged into it
(newer values win), so what waits is bounded by the number of sessions; batches are written
in order, one transaction each; a failed batch is retried in place (a newer value for the
same session queues behind it, so it still wins). `flush()` returns once what was handed
over is stored; `stop()` writes what waits, then ends the writer.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection

from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store.batch import BatchWriter

log = logging.getLogger(__name__)
#: the table itself, for Core statements (no ORM work per write)
SESSIONS = m.Base.metadata.tables[m.Session.__tablename__]

# One waiting update per session (merged), so the bound is only reached with this many
# sessions changing between two batches; a dropped update is logged.
LIMIT = 100_000


@dataclass(slots=True)
class RowUpdate:
    session_id: str
    values: dict[str, object]


def _merge(waiting: RowUpdate, new: RowUpdate) -> None:
    waiting.values.update(new.values)


class SessionRows:
    def __init__(self, db: Database, *, retry_seconds: float = 1.0) -> None:
        self._db = db
        self.writer: BatchWriter[RowUpdate] = BatchWriter(
            "session-db-writer",
            write_in=self._write_in,
            group=db.write_behind,
            limit=LIMIT,
            retry_seconds=retry_seconds,
            merge_key=lambda u: u.session_id,
            merge=_merge,
            on_drop=lambda u: log.error("session %s: a row update was dropped", u.session_id),
        )

    def persist(self, session_id: str, **values: object) -> None:
        """Write these column values of the session's row soon (in order, merged)."""
        self.writer.add(RowUpdate(session_id, dict(values)))

    async def flush(self) -> None:
        """Return once everything handed over so far is stored."""
        await self.writer.flush()

    def start(self) -> None:
        self.writer.start()

    async def stop(self) -> None:
        """Write what is pending (a failure is logged), then stop the writer."""
        await self.writer.close()

    async def _write_in(self, conn: AsyncConnection, batch: list[RowUpdate]) -> None:
        now = dt.datetime.now(dt.UTC)
        # Core statements, in the write-behind group's transaction: no ORM session
        for u in batch:
            await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == u.session_id)
                .values(**u.values, updated_at=now)
            )
