"""Where events are kept beyond the bus's ring: the `EventLog` protocol and its SQL table.

The bus (`events.py`) numbers each batch, stores it here, and only then keeps it in its ring
and fans it out; it reads older pages back from here. On PostgreSQL `append` also sends
`NOTIFY sandbox_events` in the same transaction, so followers' tails (`cluster/tail.py`) read
the new rows as soon as they are committed.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import delete, func, insert, or_, select, text
from sqlalchemy.sql.elements import ColumnElement

from agentic_sandbox.broker.observability.event import (
    SUBJECT_FIELDS,
    Event,
    EventFilter,
    type_prefix,
)
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

#: the table itself, for Core statements (no ORM work per write)
EVENTS = m.Base.metadata.tables[m.Event.__tablename__]
NOTIFY_CHANNEL = "sandbox_events"  # PostgreSQL: NOTIFY at each commit of events


class EventLog(Protocol):
    async def last_seq(self) -> int:
        """The highest seq stored (0 for an empty log): the bus continues after it."""
        ...

    async def tail(self, limit: int) -> list[Event]:
        """The newest `limit` events, oldest first (they refill the bus's ring at start)."""
        ...

    async def append(self, batch: list[Event]) -> None:
        """Store a batch, all or nothing. Seqs ascend and follow every seq stored before."""
        ...

    async def append_in(self, conn: Any, batch: list[Event]) -> None:
        """`append`, as part of the transaction of `conn` (a write-behind group's)."""
        ...

    async def read(self, after: int, limit: int, flt: EventFilter) -> list[Event]:
        """Stored events with seq > `after` that match `flt`, oldest first, at most `limit`."""
        ...

    async def holds(self, batch: list[Event]) -> bool:
        """Whether exactly this numbered batch is stored: an `append` that failed may have
        committed (its answer lost with the connection)."""
        ...


class SqlEventLog:
    """The `events` table; keeps the newest `retention` events (trimmed now and then)."""

    def __init__(self, db: Database, *, retention: int = 1_000_000) -> None:
        self._db = db
        self._retention = retention

    async def last_seq(self) -> int:
        async with self._db.session() as s:
            return int(await s.scalar(select(func.max(m.Event.seq))) or 0)

    async def tail(self, limit: int) -> list[Event]:
        async with self._db.session() as s:
            rows = (
                await s.scalars(select(m.Event).order_by(m.Event.seq.desc()).limit(limit))
            ).all()
        return [from_row(row) for row in reversed(rows)]

    async def append(self, batch: list[Event]) -> None:
        async with self._db.begin() as conn:
            await self.append_in(conn, batch)

    async def append_in(self, conn: Any, batch: list[Event]) -> None:
        if not batch:
            return
        # Core statements on a connection, not the ORM: one executemany of whole rows (no
        # ORM bulk machinery, no grouping by the columns that happen to be set)
        await conn.execute(insert(EVENTS), [row_values(ev) for ev in batch])
        last = batch[-1].seq
        if last % 1000 < len(batch):  # now and then, trim to the retention bound
            await conn.execute(delete(EVENTS).where(EVENTS.c.seq <= last - self._retention))
        if self._db.dialect == "postgresql":  # wakes the followers' tails at commit
            await conn.execute(
                text("SELECT pg_notify(:c, :n)"), {"c": NOTIFY_CHANNEL, "n": str(last)}
            )

    async def read(self, after: int, limit: int, flt: EventFilter) -> list[Event]:
        stmt = select(m.Event).where(m.Event.seq > after).order_by(m.Event.seq).limit(limit)
        if flt.types:
            stmt = stmt.where(or_(*(_type_clause(t) for t in flt.types)))
        for key in SUBJECT_FIELDS:
            want = getattr(flt, key)
            if want is not None:
                stmt = stmt.where(getattr(m.Event, key) == want)
        async with self._db.session() as s:
            rows = (await s.scalars(stmt)).all()
        return [from_row(r) for r in rows]

    async def holds(self, batch: list[Event]) -> bool:
        if not batch:
            return True
        first, last = batch[0].seq, batch[-1].seq
        async with self._db.session() as s:
            rows = (
                await s.execute(
                    select(m.Event.seq, m.Event.type, m.Event.time, m.Event.actor)
                    .where(m.Event.seq.between(first, last))
                    .order_by(m.Event.seq)
                )
            ).all()
        return [tuple(r) for r in rows] == [(e.seq, e.type, e.time, e.actor) for e in batch]


def _type_clause(pattern: str) -> ColumnElement[bool]:
    prefix = type_prefix(pattern)
    if prefix is None:
        return m.Event.type == pattern
    return m.Event.type.startswith(prefix, autoescape=True)


def row_values(ev: Event) -> dict[str, Any]:
    """The `m.Event` attributes of `ev`."""
    return {
        "seq": ev.seq,
        "type": ev.type,
        "time": ev.time,
        "actor": ev.actor,
        "instance_id": ev.instance_id,
        "session_id": ev.session_id,
        "task_id": ev.task_id,
        "host": ev.host,
        "correlation_id": ev.correlation_id,
        "owner": ev.owner,
        "payload": ev.data,
    }


def from_row(row: m.Event) -> Event:
    return Event(
        seq=row.seq,
        type=row.type,
        time=row.time,
        actor=row.actor,
        instance_id=row.instance_id,
        session_id=row.session_id,
        task_id=row.task_id,
        host=row.host,
        correlation_id=row.correlation_id,
        owner=row.owner,
        data=dict(row.payload or {}),
    )
