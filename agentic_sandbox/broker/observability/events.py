"""The event bus: one publish API for every part of the server.

Each event gets a monotonic `seq` at publish time (allocated in this process, so fan-out order
equals seq order and a cursor never skips an event that commits late), lands in a bounded ring
for fast cursor reads and live subscribers, and is persisted in batches by a background writer.
Cursor reads older than the ring come from the database.

Subscribers have bounded queues: one that falls behind is told how many events it missed
(a `stream.gap` marker) and continues from the ring instead of slowing the publisher.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, or_, select

from agentic_sandbox.broker.observability.logs import correlation_id, redactor
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

EVENT_TYPE_PREFIXES = (
    "instance.",
    "agent.",
    "session.",
    "task.",
    "host.",
    "image.",
    "auth.",
    "operation.",
    "stream.",
)


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    time: dt.datetime
    actor: str | None = None
    instance_id: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    host: str | None = None
    correlation_id: str | None = None
    owner: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "type": self.type, "time": self.time.isoformat()}
        for key in (
            "actor",
            "instance_id",
            "session_id",
            "task_id",
            "host",
            "correlation_id",
            "owner",
        ):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["data"] = self.data
        return out

    @classmethod
    def from_row(cls, row: m.Event) -> Event:
        return cls(
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


@dataclass(frozen=True)
class EventFilter:
    owner: str | None = None  # non-admins see only events about what they own
    types: tuple[str, ...] = ()  # exact names or prefixes ending in `*` / `.`
    instance_id: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    host: str | None = None

    def matches(self, ev: Event) -> bool:
        if self.types and not any(_type_matches(t, ev.type) for t in self.types):
            return False
        for key in ("owner", "instance_id", "session_id", "task_id", "host"):
            want = getattr(self, key)
            if want is not None and getattr(ev, key) != want:
                return False
        return True


def _type_matches(pattern: str, value: str) -> bool:
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    if pattern.endswith("."):
        return value.startswith(pattern)
    return value == pattern


class Subscription:
    """A live follower. Iterate it; a `stream.gap` event says events were skipped."""

    def __init__(self, bus: EventBus, flt: EventFilter, size: int) -> None:
        self._bus = bus
        self.filter = flt
        self._queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=size)
        self.overflowed_at: int | None = None  # seq of the first event that did not fit
        self.closed = False

    def offer(self, ev: Event) -> None:
        if self.overflowed_at is not None or not self.filter.matches(ev):
            return
        try:
            self._queue.put_nowait(ev)
        except asyncio.QueueFull:
            self.overflowed_at = ev.seq

    async def get(self) -> Event:
        if self._queue.empty() and self.overflowed_at is not None:
            return self._bus.gap_marker(self.overflowed_at)
        return await self._queue.get()

    def resume_after_gap(self, last_seq: int) -> None:
        """After a consumer handled a gap marker, follow the ring from `last_seq` again."""
        self.overflowed_at = None
        for ev in self._bus.ring_after(last_seq):
            self.offer(ev)

    def close(self) -> None:
        """Stop following; a consumer waiting in get() receives a `stream.end` marker."""
        if self.closed:
            return
        self.closed = True
        self._bus._subscribers.discard(self)
        end = Event(seq=0, type="stream.end", time=dt.datetime.now(dt.UTC))
        while True:
            try:
                self._queue.put_nowait(end)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()


class EventBus:
    def __init__(
        self,
        db: Database,
        *,
        ring_size: int = 10_000,
        retention: int = 1_000_000,
        on_publish: Callable[[Event], None] | None = None,
    ) -> None:
        self._db = db
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._retention = retention
        self._seq = 0
        self._subscribers: set[Subscription] = set()
        self._pending: deque[Event] = deque()
        self._pending_limit = max(ring_size * 10, 100_000)
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[Event], None]] = []
        if on_publish is not None:
            self._listeners.append(on_publish)
        self.dropped_persist = 0
        self._flush_lock = asyncio.Lock()

    @property
    def last_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        async with self._db.session() as s:
            last = await s.scalar(select(func.max(m.Event.seq)))
            self._seq = int(last or 0)
            rows = (
                await s.scalars(
                    select(m.Event).order_by(m.Event.seq.desc()).limit(self._ring.maxlen or 0)
                )
            ).all()
        for row in reversed(rows):
            self._ring.append(Event.from_row(row))
        self._writer = asyncio.create_task(self._write_loop(), name="event-writer")

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        """In-process hooks (metrics, push, …); must not block."""
        self._listeners.append(fn)

    def publish(
        self,
        type: str,
        *,
        actor: str | None = None,
        instance_id: str | None = None,
        session_id: str | None = None,
        task_id: str | None = None,
        host: str | None = None,
        owner: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> Event:
        if not type.startswith(EVENT_TYPE_PREFIXES):
            raise ValueError(f"event type {type!r} is outside the known families")
        self._seq += 1
        ev = Event(
            seq=self._seq,
            type=type,
            time=dt.datetime.now(dt.UTC),
            actor=actor,
            instance_id=instance_id,
            session_id=session_id,
            task_id=task_id,
            host=host,
            correlation_id=correlation_id.get(),
            owner=owner,
            data=redactor.data(data or {}),
        )
        self._ring.append(ev)
        if len(self._pending) >= self._pending_limit:
            self._pending.popleft()
            self.dropped_persist += 1
        self._pending.append(ev)
        self._wake.set()
        for sub in tuple(self._subscribers):
            sub.offer(ev)
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:  # a listener's bug must not break publishers
                log.exception("event listener failed")
        return ev

    def gap_marker(self, first_missed: int) -> Event:
        return Event(
            seq=first_missed - 1,
            type="stream.gap",
            time=dt.datetime.now(dt.UTC),
            data={
                "first_missed_seq": first_missed,
                "reason": "client fell behind; resume with after=<last seq you handled>",
            },
        )

    def ring_after(self, after: int) -> list[Event]:
        if not self._ring or after >= self._ring[-1].seq:
            return []
        first = self._ring[0].seq
        start = max(0, after - first + 1)
        return list(self._ring)[start:]

    def subscribe(self, flt: EventFilter, queue_size: int = 1000) -> Subscription:
        sub = Subscription(self, flt, queue_size)
        self._subscribers.add(sub)
        return sub

    async def query(self, after: int, limit: int, flt: EventFilter) -> list[Event]:
        """Events with seq > after, oldest first, at most `limit`."""
        ring_first = self._ring[0].seq if self._ring else self._seq + 1
        if after + 1 >= ring_first:
            out = []
            for ev in self.ring_after(after):
                if flt.matches(ev):
                    out.append(ev)
                    if len(out) >= limit:
                        break
            return out
        await self.flush()
        stmt = select(m.Event).where(m.Event.seq > after).order_by(m.Event.seq).limit(limit)
        if flt.types:
            clauses = []
            for t in flt.types:
                if t.endswith("*"):
                    clauses.append(m.Event.type.startswith(t[:-1], autoescape=True))
                elif t.endswith("."):
                    clauses.append(m.Event.type.startswith(t, autoescape=True))
                else:
                    clauses.append(m.Event.type == t)
            stmt = stmt.where(or_(*clauses))
        for key in ("owner", "instance_id", "session_id", "task_id", "host"):
            want = getattr(flt, key)
            if want is not None:
                stmt = stmt.where(getattr(m.Event, key) == want)
        async with self._db.session() as s:
            rows = (await s.scalars(stmt)).all()
        return [Event.from_row(r) for r in rows]

    async def follow(
        self, after: int, flt: EventFilter, queue_size: int
    ) -> AsyncGenerator[Event, None]:
        """Replay everything after `after`, then live events, with no gap and no duplicate."""
        sub = self.subscribe(flt, queue_size)  # subscribe first: nothing published is lost
        try:
            last = after
            while True:
                page = await self.query(last, 200, flt)
                if not page:
                    break
                for ev in page:
                    yield ev
                    last = ev.seq
            while True:
                ev = await sub.get()
                if ev.type == "stream.end":
                    return
                if ev.type == "stream.gap":
                    yield ev
                    sub.resume_after_gap(last)
                    continue
                if ev.seq <= last:
                    continue
                yield ev
                last = ev.seq
        finally:
            sub.close()

    async def flush(self) -> None:
        """Persist everything published so far (a batch leaves the queue only once stored)."""
        async with self._flush_lock:
            while self._pending:
                batch = list(itertools.islice(self._pending, 0, 500))
                await self._persist(batch)
                for _ in batch:
                    self._pending.popleft()

    async def _persist(self, batch: Iterable[Event]) -> None:
        rows = [
            m.Event(
                seq=ev.seq,
                type=ev.type,
                time=ev.time,
                actor=ev.actor,
                instance_id=ev.instance_id,
                session_id=ev.session_id,
                task_id=ev.task_id,
                host=ev.host,
                correlation_id=ev.correlation_id,
                owner=ev.owner,
                payload=ev.data,
            )
            for ev in batch
        ]
        async with self._db.session() as s:
            s.add_all(rows)
            last = rows[-1].seq
            if last % 1000 < len(rows):  # now and then, trim to the retention bound
                await s.execute(delete(m.Event).where(m.Event.seq <= last - self._retention))

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("persisting events failed; retrying")
                await asyncio.sleep(1)
                self._wake.set()

    def end_streams(self) -> None:
        """Wake and end every live follower (server shutdown)."""
        for sub in tuple(self._subscribers):
            sub.close()

    async def close(self) -> None:
        self.end_streams()
        if self._writer is not None:
            async with self._flush_lock:  # never cancel a batch mid-write (see AuditLog.close)
                self._writer.cancel()
            try:
                await self._writer
            except asyncio.CancelledError:
                pass
        try:
            await self.flush()
        except Exception:
            log.exception("final event flush failed")
