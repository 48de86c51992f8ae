"""The EventBus in process, over an EventLog: seq assigned when stored, fan-out only of what
is stored, ring, cursor reads beyond the ring, follow without gap or duplicate, no hole when
the writer's bound drops events, a follower's pull and promotion. Fast feedback beside the
process-level tests in tests/integration/foundation/test_events.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox.broker.observability.event import Event, EventFilter
from agentic_sandbox.broker.observability.eventlog import EventLog, SqlEventLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.store import Database


class MemoryLog:
    """An EventLog in a list; `fail` makes appends fail, `gate` holds them."""

    def __init__(self, events: list[Event] | None = None) -> None:
        self.events: list[Event] = list(events or [])
        self.appends = 0
        self.fail = 0
        self.lose_answers = 0  # appends that store the batch, then fail (a lost commit answer)
        self.gate: asyncio.Event | None = None

    async def last_seq(self) -> int:
        return self.events[-1].seq if self.events else 0

    async def tail(self, limit: int) -> list[Event]:
        return self.events[-limit:] if limit else []

    async def append(self, batch: list[Event]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("log unavailable")
        if self.events and batch[0].seq <= self.events[-1].seq:
            raise RuntimeError("duplicate key: seq")  # as the primary key answers
        self.events.extend(batch)
        self.appends += 1
        if self.lose_answers:
            self.lose_answers -= 1
            raise ConnectionResetError("connection lost after the commit")

    async def append_in(self, conn: Any, batch: list[Event]) -> None:
        await self.append(batch)

    async def holds(self, batch: list[Event]) -> bool:
        stored = {e.seq: e for e in self.events}
        return all(stored.get(e.seq) == e for e in batch)

    async def read(self, after: int, limit: int, flt: EventFilter) -> list[Event]:
        return [e for e in self.events if e.seq > after and flt.matches(e)][:limit]


def seqs(events: list[Event]) -> list[int]:
    return [e.seq for e in events]


async def started(log: EventLog, ring_size: int = 10_000) -> EventBus:
    bus = EventBus(log, ring_size=ring_size)
    await bus.start()
    return bus


def test_memory_log_is_an_event_log() -> None:
    log: EventLog = MemoryLog()  # mypy checks the protocol here
    assert log is not None


async def test_publish_numbers_fans_out_and_persists_in_batches() -> None:
    log = MemoryLog()
    bus = await started(log)
    sub = bus.subscribe(EventFilter(types=("host.*",)))
    for i in range(50):
        bus.publish("host.added" if i % 2 else "instance.created", data={"i": i})
    await bus.flush()
    assert bus.last_seq == 50
    assert seqs(log.events) == list(range(1, 51))
    assert log.appends < 50  # batched, not one write per event
    got = [await sub.get() for _ in range(25)]
    assert seqs(got) == list(range(2, 51, 2))
    await bus.close()


async def test_start_continues_the_sequence_and_refills_the_ring() -> None:
    log = MemoryLog()
    bus = await started(log, ring_size=10)
    for _ in range(30):
        bus.publish("task.created")
    await bus.close()
    again = await started(log, ring_size=10)
    assert again.last_seq == 30
    assert seqs(again.ring_after(0)) == list(range(21, 31))
    again.publish("task.created")
    await again.flush()
    assert again.last_seq == 31 and log.events[-1].seq == 31
    await again.close()


async def test_reads_older_than_the_ring_come_from_the_log() -> None:
    log = MemoryLog()
    log.gate = asyncio.Event()  # nothing reaches the log until a read needs it
    bus = await started(log, ring_size=5)
    for i in range(20):
        bus.publish("session.opened", data={"i": i})
    reading = asyncio.create_task(bus.query(0, 100, EventFilter()))
    await asyncio.sleep(0.01)
    assert not reading.done()  # it waits for the log to hold what the ring lost
    log.gate.set()
    assert seqs(await reading) == list(range(1, 21))
    assert seqs(await bus.query(17, 100, EventFilter())) == [18, 19, 20]  # from the ring
    assert await bus.query(20, 100, EventFilter()) == []
    await bus.close()


async def test_follow_replays_then_goes_live_without_gap_or_duplicate() -> None:
    log = MemoryLog()
    bus = await started(log, ring_size=8)
    for _ in range(300):  # more than one replay page, most of it beyond the ring
        bus.publish("agent.connected")
    got: list[int] = []
    gen = bus.follow(10, EventFilter(), queue_size=1000)
    async for ev in gen:
        got.append(ev.seq)
        if ev.seq == 150:
            for _ in range(5):  # published during the replay
                bus.publish("agent.connected")
        if len(got) == 300 - 10 + 5:
            bus.publish("agent.connected")  # live
        if len(got) == 300 - 10 + 6:
            break
    await gen.aclose()
    assert got == list(range(11, 307))
    await bus.close()


async def test_a_slow_follower_gets_a_gap_marker_then_resumes_from_the_ring() -> None:
    bus = await started(MemoryLog())
    sub = bus.subscribe(EventFilter(), queue_size=3)
    for _ in range(10):
        bus.publish("image.built")
    await bus.flush()
    got = [await sub.get() for _ in range(4)]
    assert seqs(got[:3]) == [1, 2, 3]
    assert got[3].type == "stream.gap" and got[3].data["first_missed_seq"] == 4
    sub.resume_after_gap(3)
    assert seqs([await sub.get() for _ in range(3)]) == [4, 5, 6]
    sub.close()
    await bus.close()


async def test_end_streams_ends_followers() -> None:
    bus = await started(MemoryLog())
    gen = bus.follow(0, EventFilter(), queue_size=10)
    nxt = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    bus.end_streams()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(nxt, 2)
    await bus.close()


async def test_a_batch_whose_commit_answer_was_lost_is_shown_once_not_retried() -> None:
    log = MemoryLog()
    log.lose_answers = 1
    bus = await started(log)
    sub = bus.subscribe(EventFilter())
    for _ in range(3):
        bus.publish("operation.started")
    await bus.flush()  # stored, though the append raised: not retried into its own keys
    bus.publish("operation.succeeded")
    await bus.flush()
    assert seqs(log.events) == [1, 2, 3, 4] and log.appends == 2
    assert bus.last_seq == 4
    assert seqs([await sub.get() for _ in range(4)]) == [1, 2, 3, 4]  # each once
    await bus.close()


async def test_a_failing_log_is_retried_in_order_and_close_flushes() -> None:
    log = MemoryLog()
    log.fail = 1
    bus = await started(log)
    for _ in range(5):
        bus.publish("operation.started")
    with pytest.raises(RuntimeError):
        await bus.flush()  # a read that needs the log hears why it cannot have it
    for _ in range(5):
        bus.publish("operation.started")
    await bus.flush()  # a flush retries at once
    assert seqs(log.events) == list(range(1, 11))
    for _ in range(5):
        bus.publish("operation.started")
    await bus.close()
    assert seqs(log.events) == list(range(1, 16))
    assert bus.writer.dropped == 0


async def test_unknown_event_families_are_refused() -> None:
    bus = await started(MemoryLog())
    with pytest.raises(ValueError):
        bus.publish("weather.rain")
    await bus.close()


async def test_the_sql_log_filters_as_the_ring_does(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'ev.db'}")
    await db.migrate()
    try:
        log = SqlEventLog(db, retention=1000)
        bus = await started(log, ring_size=1000)
        kinds = ("instance.created", "instance.deleted", "session.opened", "host.added")
        for i in range(40):
            bus.publish(
                kinds[i % 4], instance_id=f"vm-{i % 3}", owner=("ann", "bob")[i % 2], data={"i": i}
            )
        await bus.flush()
        filters = [
            EventFilter(),
            EventFilter(types=("instance.*",)),
            EventFilter(types=("instance.", "host.added")),
            EventFilter(types=("session.opened",), owner="ann"),
            EventFilter(instance_id="vm-1", owner="bob"),
            EventFilter(types=("instance_",)),  # `_` is no wildcard
        ]
        for flt in filters:
            from_ring = await bus.query(0, 100, flt)
            from_log = await log.read(0, 100, flt)
            assert from_log == from_ring, flt
        assert (await log.read(5, 3, EventFilter()))[0].seq == 6
        await bus.close()
        again = await started(SqlEventLog(db), ring_size=10)
        assert again.last_seq == 40 and seqs(again.ring_after(0)) == list(range(31, 41))
        await again.close()
    finally:
        await db.close()


async def test_nobody_sees_an_event_before_the_log_has_stored_it() -> None:
    log = MemoryLog()
    log.gate = asyncio.Event()  # the append blocks
    bus = await started(log)
    sub = bus.subscribe(EventFilter())
    bus.publish("instance.created")
    bus.publish("instance.deleted")
    getting = asyncio.create_task(sub.get())
    for _ in range(20):  # the writer runs and waits in append
        await asyncio.sleep(0)
    assert not getting.done() and bus.last_seq == 0 and bus.ring_after(0) == []
    log.gate.set()
    first = await asyncio.wait_for(getting, 2)
    assert first.seq == 1 and first.type == "instance.created"
    assert (await sub.get()).seq == 2 and bus.last_seq == 2
    assert seqs(log.events) == [1, 2]
    await bus.close()


async def test_events_dropped_by_the_writers_bound_leave_no_hole() -> None:
    log = MemoryLog()
    log.gate = asyncio.Event()
    bus = EventBus(log, pending_limit=10)
    await bus.start()
    sub = bus.subscribe(EventFilter(), queue_size=1000)
    for i in range(40):  # the first batch is in flight; most of the rest is dropped
        bus.publish("task.created", data={"i": i})
    await asyncio.sleep(0)
    assert bus.writer.dropped > 0
    log.gate.set()
    await bus.flush()
    stored = seqs(log.events)
    assert stored == list(range(1, len(stored) + 1))  # contiguous from 1
    assert len(stored) == 40 - bus.writer.dropped
    got = [await sub.get() for _ in range(len(stored))]
    assert seqs(got) == stored and bus.last_seq == stored[-1]
    assert log.events[-1].data == {"i": 39}  # the newest survive
    await bus.close()


async def test_a_failed_batch_keeps_its_numbers_and_drops_do_not_renumber_stored() -> None:
    log = MemoryLog()
    log.fail = 1
    bus = EventBus(log, pending_limit=4)
    await bus.start()
    for i in range(3):
        bus.publish("task.created", data={"i": i})
    with pytest.raises(RuntimeError):
        await bus.flush()
    for i in range(3, 8):  # overflows: the oldest waiting (the failed batch) go first
        bus.publish("task.created", data={"i": i})
    await bus.flush()
    assert seqs(log.events) == list(range(1, len(log.events) + 1))
    assert [e.data["i"] for e in log.events] == list(range(8 - len(log.events), 8))
    await bus.close()


async def test_a_follower_pulls_what_the_leader_stored_then_leads_after_it() -> None:
    log = MemoryLog()
    leader = await started(log)
    follower = EventBus(log, standby=True)
    await follower.start()
    sub = follower.subscribe(EventFilter())
    for _ in range(5):
        leader.publish("host.added")
    follower.publish("auth.denied")  # a follower's own event reaches its listeners only
    await leader.flush()
    assert follower.last_seq == 0 and await follower.newest() == 5
    assert await follower.pull() == 5
    assert seqs([await sub.get() for _ in range(5)]) == [1, 2, 3, 4, 5]
    for _ in range(3):  # the old leader stores more, then dies
        leader.publish("host.added")
    await leader.flush()
    await follower.lead()  # takes in 6..8 and continues after them
    assert seqs([await sub.get() for _ in range(3)]) == [6, 7, 8]
    follower.publish("host.added")
    await follower.flush()
    assert seqs(log.events) == list(range(1, 10))
    assert (await sub.get()).seq == 9
    assert len([e for e in log.events if e.type == "auth.denied"]) == 0
    await follower.close()
    await leader.close()


async def test_the_sql_log_tells_a_stored_batch_from_another(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'ev.db'}")
    await db.migrate()
    try:
        log = SqlEventLog(db)
        bus = await started(log)
        for i in range(3):
            bus.publish("instance.created", actor="admin", data={"i": i})
        await bus.flush()
        stored = await log.read(0, 10, EventFilter())
        assert await log.holds(stored)
        with pytest.raises(Exception, match="UNIQUE"):
            await log.append(stored)  # what a blind retry of a committed batch meets
        other = [dataclasses.replace(stored[1], type="instance.deleted")]
        assert not await log.holds(other)
        assert not await log.holds([dataclasses.replace(stored[2], seq=4)])
        await bus.close()
    finally:
        await db.close()
