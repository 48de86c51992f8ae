"""The event bus: one publish API for every part of the server.

Each event gets a monotonic `seq` at publish time (allocated in this process, so fan-out order
equals seq order and a cursor never skips an event that commits late), lands in a bounded ring
for fast cursor reads and live subscribers, and is handed to the event log (`eventlog.py`) in
batches by a write-behind `BatchWriter`. Cursor reads older than the ring come from the log.

Subscribers have bounded queues: one that falls behind is told how many events it missed
(a `stream.gap` marker) and continues from the ring instead of slowing the publisher.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from agentic_sandbox.broker.observability.event import EVENT_TYPE_PREFIXES, Event, EventFilter
from agentic_sandbox.broker.observability.eventlog import EventLog
from agentic_sandbox.broker.observability.logs import correlation_id, redactor
from agentic_sandbox.broker.store.batch import BatchWriter

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
    ) -> None:
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
        self.writer: BatchWriter[Event] = BatchWriter(
            "event-writer", log.append, limit=max(ring_size * 10, 100_000)
        )

    @property
    def last_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        self._seq = await self._log.last_seq()
        self._ring.extend(await self._log.tail(self._ring.maxlen or 0))
        self.writer.start()

    async def lead(self) -> None:
        """This node now leads: continue the sequence from the log (a no-op for a bus that
        was never on standby)."""
        if not self.standby:
            return
        self._seq = await self._log.last_seq()
        self._ring.clear()
        self._ring.extend(await self._log.tail(self._ring.maxlen or 0))
        self.standby = False

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
        if not self.standby:
            self._seq += 1
        ev = Event(
            seq=0 if self.standby else self._seq,
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
        if not self.standby:
            self._ring.append(ev)
            self.writer.add(ev)
            for sub in tuple(self._subscribers):
                sub.offer(ev)
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
        """Events with seq > after, oldest first, at most `limit`."""
        if self.standby:
            return await self._log.read(after, limit, flt)
        ring_first = self._ring[0].seq if self._ring else self._seq + 1
        if after + 1 >= ring_first:
            out = []
            for ev in self.ring_after(after):
                if flt.matches(ev):
                    out.append(ev)
                    if len(out) >= limit:
                        break
            return out
        await self.flush()  # what the ring has lost must be in the log first
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
