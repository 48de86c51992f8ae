"""The event bus: one publish API for every part of the server.

`publish()` hands an event to a write-behind `BatchWriter` and to the in-process listeners
(metrics, push) at once. The writer's step numbers each batch `last_seq+1…` (the same numbers
on a retry, since `last_seq` moves only after a commit), stores it in the event log
(`eventlog.py`), and only then puts it in the bounded ring, offers it to live subscribers and
advances `last_seq`. So nobody ever sees an event that is not stored (a leader killed before
its commit leaves nothing a client has seen), and an event dropped by the writer's bound was
never numbered: the sequence has no hole. Cursor reads older than the ring come from the log.

With several control hosts a follower's bus is on standby: the leader's writer owns the
sequence, and the follower's tail (`cluster/tail.py`) calls `pull()` to bring what the leader
stored into the ring and to this node's subscribers. `lead()` takes the sequence over.

Subscribers have bounded queues: one that falls behind is told how many events it missed
(a `stream.gap` marker) and continues from the ring instead of slowing the publisher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from agentic_sandbox.broker.observability.event import EVENT_TYPE_PREFIXES, Event, EventFilter
from agentic_sandbox.broker.observability.eventlog import EventLog
from agentic_sandbox.broker.observability.logs import correlation_id, redactor
from agentic_sandbox.broker.store.batch import BatchWriter, WriteGroup

log = logging.getLogger(__name__)

PAGE = 200  # events per log read while a follower replays


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
            return gap_marker(self.overflowed_at)
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
        self._bus.unsubscribe(self)
        end = Event(seq=0, type="stream.end", time=dt.datetime.now(dt.UTC))
        while True:
            try:
                self._queue.put_nowait(end)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()


def gap_marker(first_missed: int) -> Event:
    return Event(
        seq=first_missed - 1,
        type="stream.gap",
        time=dt.datetime.now(dt.UTC),
        data={
            "first_missed_seq": first_missed,
            "reason": "client fell behind; resume with after=<last seq you handled>",
        },
    )


class EventBus:
    def __init__(
        self,
        log: EventLog,
        *,
        ring_size: int = 10_000,
        on_publish: Callable[[Event], None] | None = None,
        standby: bool = False,
        pending_limit: int | None = None,
        group: WriteGroup | None = None,
    ) -> None:
        """With `group` the bus's writes share the transactions of the other write-behind
        writers (`log.append_in`); without, each batch is its own (`log.append`)."""
        self._log = log
        # A follower's bus (several control hosts): the leader owns the sequence, so events
        # published here reach the in-process listeners (metrics) only, and reads go to the
        # log. `lead()` takes the sequence over from the log.
        self.standby = standby
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._seq = 0
        self._subscribers: set[Subscription] = set()
        self._listeners: list[Callable[[Event], None]] = []
        if on_publish is not None:
            self._listeners.append(on_publish)
        # Events not yet in the log. Past its bound the oldest unwritten ones are dropped
        # (counted in `writer.dropped`, exposed as a metric): publishers never wait.
        grouped = group is not None
        self.writer: BatchWriter[Event] = BatchWriter(
            "event-writer",
            None if grouped else log.append,
            write_in=log.append_in if grouped else None,
            group=group,
            limit=pending_limit or max(ring_size * 10, 100_000),
            # each try numbers the batch after the newest stored event; only a stored batch
            # is shown; a commit whose answer was lost (the connection broke after it)
            # stored it, and its retry would collide with itself on every try: shown once
            prepare=self._number,
            stored=self._ingest,
            stored_anyway=log.holds,
        )

    @property
    def last_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        self._seq = await self._log.last_seq()
        self._ring.extend(await self._log.tail(self._ring.maxlen or 0))
        self.writer.start()

    async def lead(self) -> None:
        """This node now leads (after the term bump, so no older leader's commit can land):
        take in what the old leader stored, then continue the sequence from the log (a no-op
        for a bus that was never on standby). Stop the tail first."""
        if not self.standby:
            return
        await self.pull()
        self._seq = max(self._seq, await self._log.last_seq())
        if not self._ring or self._ring[-1].seq != self._seq:
            self._ring.clear()
            self._ring.extend(await self._log.tail(self._ring.maxlen or 0))
        self.standby = False

    async def pull(self) -> int:
        """A follower: bring every event stored after `last_seq` into the ring and to the
        subscribers, in order. Returns how many came."""
        count = 0
        while True:
            page = await self._log.read(self._seq, PAGE, EventFilter())
            if not page:
                return count
            self._ingest(page)
            count += len(page)

    async def newest(self) -> int:
        """The newest seq a cursor may name: `last_seq`, or on a follower whatever the log
        holds already (its tail may be a poll behind the leader)."""
        if self.standby:
            return max(self._seq, await self._log.last_seq())
        return self._seq

    def _ingest(self, stored: list[Event]) -> None:
        """Stored events, ascending: into the ring, to the subscribers, `last_seq` on."""
        for ev in stored:
            if ev.seq <= self._seq:
                continue  # already here
            self._ring.append(ev)
            for sub in tuple(self._subscribers):
                sub.offer(ev)
            self._seq = ev.seq

    def _number(self, batch: list[Event]) -> list[Event]:
        """The writer's step: number the batch after the newest stored event (a failed
        batch is numbered the same way on its retry)."""
        first = self._seq + 1
        return [dataclasses.replace(ev, seq=first + i) for i, ev in enumerate(batch)]

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
        ev = Event(
            seq=0,  # the writer numbers it when it stores it
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
        if not self.standby:  # a follower's own events reach its listeners only
            self.writer.add(ev)
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:  # a listener's bug must not break publishers
                log.exception("event listener failed")
        return ev

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

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    async def query(self, after: int, limit: int, flt: EventFilter) -> list[Event]:
        """Events with seq > after, oldest first, at most `limit`. On the leader it waits
        for what was published before the call to be stored (a caller reads its own events)."""
        if self.standby:
            return await self._log.read(after, limit, flt)
        if self.writer.pending:
            try:
                await self.flush()
            except Exception:  # the log refuses writes: serve what is stored
                log.warning("events: reading while the log refuses writes", exc_info=True)
        ring_first = self._ring[0].seq if self._ring else self._seq + 1
        if after + 1 >= ring_first:
            out = []
            for ev in self.ring_after(after):
                if flt.matches(ev):
                    out.append(ev)
                    if len(out) >= limit:
                        break
            return out
        return await self._log.read(after, limit, flt)

    async def follow(
        self, after: int, flt: EventFilter, queue_size: int
    ) -> AsyncGenerator[Event, None]:
        """Replay everything after `after`, then live events, with no gap and no duplicate."""
        sub = self.subscribe(flt, queue_size)  # subscribe first: nothing published is lost
        try:
            last = after
            while True:
                page = await self.query(last, PAGE, flt)
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
        """Make everything published so far durable in the log."""
        await self.writer.flush()

    def end_streams(self) -> None:
        """Wake and end every live follower (server shutdown)."""
        for sub in tuple(self._subscribers):
            sub.close()

    async def close(self) -> None:
        self.end_streams()
        await self.writer.close()
