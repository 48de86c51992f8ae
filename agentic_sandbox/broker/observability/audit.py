"""The audit log: state transitions and denied requests, with actor, cause and time.

Entries are written by a write-behind `BatchWriter` (callers never wait on the database) and
are queryable by subject. `flush()` makes everything recorded so far durable.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from agentic_sandbox.broker.observability.logs import correlation_id, redactor
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store.batch import BatchWriter

log = logging.getLogger(__name__)
#: the table itself, for Core statements (no ORM work per write)
AUDIT = m.Base.metadata.tables[m.AuditEntry.__tablename__]


@dataclass(frozen=True)
class AuditRecord:
    actor: str
    action: str
    subject_type: str
    subject_id: str
    outcome: str = "ok"  # ok | denied | failed
    cause: str = ""
    from_state: str | None = None
    to_state: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    time: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    correlation_id: str | None = None


class AuditLog:
    def __init__(self, db: Database, *, limit: int = 100_000) -> None:
        self._db = db
        # Past `limit` unwritten entries the oldest is dropped (callers never wait), counted
        # in `writer.dropped` and exposed as a metric.
        self.writer: BatchWriter[AuditRecord] = BatchWriter(
            "audit-writer",
            write_in=self._write_in,
            group=db.write_behind,
            limit=limit,
            on_drop=_dropped,
        )

    async def start(self) -> None:
        self.writer.start()

    def record(
        self,
        actor: str,
        action: str,
        subject_type: str,
        subject_id: str,
        *,
        outcome: str = "ok",
        cause: str = "",
        from_state: str | None = None,
        to_state: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        self.writer.add(
            AuditRecord(
                # Clipped to their columns (PostgreSQL refuses longer values, and one bad row
                # would hold back every batch after it): a request path or a route template
                # can be longer than the column.
                actor=actor[:128],
                action=action[:64],
                subject_type=subject_type[:32],
                subject_id=subject_id[:128],
                outcome=outcome,
                cause=redactor.text(cause),
                from_state=from_state,
                to_state=to_state,
                detail=redactor.data(detail or {}),
                correlation_id=correlation_id.get(),
            )
        )

    def transition(
        self,
        actor: str,
        subject_type: str,
        subject_id: str,
        from_state: str | None,
        to_state: str,
        *,
        cause: str = "",
        detail: dict[str, Any] | None = None,
    ) -> None:
        self.record(
            actor,
            f"{subject_type}.transition",
            subject_type,
            subject_id,
            cause=cause,
            from_state=from_state,
            to_state=to_state,
            detail=detail,
        )

    def denied(
        self, actor: str, action: str, subject_type: str, subject_id: str, cause: str
    ) -> None:
        self.record(actor, action, subject_type, subject_id, outcome="denied", cause=cause)

    async def query(
        self,
        *,
        subject_type: str | None = None,
        subject_id: str | None = None,
        actor: str | None = None,
        outcome: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> list[m.AuditEntry]:
        await self.flush()
        stmt = select(m.AuditEntry).where(m.AuditEntry.id > after).order_by(m.AuditEntry.id)
        if subject_type:
            stmt = stmt.where(m.AuditEntry.subject_type == subject_type)
        if subject_id:
            stmt = stmt.where(m.AuditEntry.subject_id == subject_id)
        if actor:
            stmt = stmt.where(m.AuditEntry.actor == actor)
        if outcome:
            stmt = stmt.where(m.AuditEntry.outcome == outcome)
        async with self._db.session() as s:
            return list((await s.scalars(stmt.limit(limit))).all())

    async def flush(self) -> None:
        """Make everything recorded so far durable."""
        await self.writer.flush()

    async def _write_in(self, conn: AsyncConnection, batch: list[AuditRecord]) -> None:
        # one Core executemany of whole rows, in the write-behind group's transaction
        await conn.execute(
            insert(AUDIT),
            [
                {
                    "time": r.time,
                    "actor": r.actor,
                    "action": r.action,
                    "subject_type": r.subject_type,
                    "subject_id": r.subject_id,
                    "outcome": r.outcome,
                    "cause": r.cause,
                    "from_state": r.from_state,
                    "to_state": r.to_state,
                    "correlation_id": r.correlation_id,
                    "detail": r.detail,
                }
                for r in batch
            ],
        )

    async def close(self) -> None:
        await self.writer.close()


def _dropped(_record: AuditRecord) -> None:
    log.error("audit backlog full; oldest unwritten entry dropped")
