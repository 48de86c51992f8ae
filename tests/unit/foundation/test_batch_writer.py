"""The write-behind BatchWriter: bounded, ordered, merged on request, retried without loss or
reordering, and flushed on stop without being cancelled mid-write."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from agentic_sandbox.broker.store.batch import BatchWriter, WriteGroup


class Store:
    """A fake table: records every committed batch; can fail or block on demand."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.fail_next = 0
        self.gate: asyncio.Event | None = None  # when set, writes wait for it
        self.writing = asyncio.Event()

    @property
    def rows(self) -> list[int]:
        return [r for b in self.batches for r in b]

    async def write(self, batch: list[int]) -> None:
        self.writing.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("database is locked")
        self.batches.append(list(batch))


async def test_items_are_written_in_order_in_batches() -> None:
    store = Store()
    w = BatchWriter("t", store.write, limit=1000, batch_size=4)
    w.start()
    for i in range(10):
        w.add(i)
    await w.flush()
    assert store.rows == list(range(10))
    assert all(len(b) <= 4 for b in store.batches)
    assert w.pending == 0
    await w.close()


async def test_a_failed_batch_is_retried_whole_and_in_order() -> None:
    store = Store()
    store.fail_next = 2
    w = BatchWriter("t", store.write, limit=1000, batch_size=3, retry_seconds=0.01)
    w.start()
    for i in range(7):
        w.add(i)
    with pytest.raises(RuntimeError):
        await w.flush()  # the caller hears of the failure, as with a direct write
    for i in range(7, 9):
        w.add(i)
    for _ in range(100):
        try:
            await w.flush()
            break
        except RuntimeError:
            continue
    assert store.rows == list(range(9))
    await w.close()


async def test_bounded_drops_the_oldest_waiting_never_the_batch_in_flight() -> None:
    store = Store()
    store.gate = asyncio.Event()
    dropped: list[int] = []
    w = BatchWriter("t", store.write, limit=5, batch_size=2, on_drop=dropped.append)
    w.start()
    w.add(0)
    w.add(1)
    await store.writing.wait()  # [0, 1] in flight
    for i in range(2, 9):
        w.add(i)
    assert w.pending == 5
    assert dropped == [2, 3, 4, 5] and w.dropped == 4
    store.gate.set()
    await w.flush()
    assert store.rows == [0, 1, 6, 7, 8]
    await w.close()


@dataclass
class Row:
    key: str
    values: dict[str, int] = field(default_factory=dict)


def merge(waiting: Row, new: Row) -> None:
    waiting.values.update(new.values)


async def test_items_with_the_same_key_merge_while_they_wait() -> None:
    written: list[list[tuple[str, dict[str, int]]]] = []
    gate = asyncio.Event()
    writing = asyncio.Event()

    async def write(batch: list[Row]) -> None:
        writing.set()
        await gate.wait()
        written.append([(r.key, dict(r.values)) for r in batch])

    w = BatchWriter("t", write, limit=100, merge_key=lambda r: r.key, merge=merge)
    w.start()
    w.add(Row("a", {"x": 1}))
    await writing.wait()  # ("a", x=1) is in flight: later values queue behind it
    w.add(Row("a", {"x": 2}))
    w.add(Row("b", {"y": 1}))
    w.add(Row("a", {"z": 3}))
    assert w.pending == 3
    gate.set()
    await w.flush()
    assert written == [[("a", {"x": 1})], [("a", {"x": 2, "z": 3}), ("b", {"y": 1})]]
    await w.close()


async def test_a_failed_merged_batch_keeps_newer_values_behind_it() -> None:
    applied: dict[str, dict[str, int]] = {}
    fail = [True]

    async def write(batch: list[Row]) -> None:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("disk I/O error")
        for r in batch:
            applied.setdefault(r.key, {}).update(r.values)

    w = BatchWriter(
        "t", write, limit=100, merge_key=lambda r: r.key, merge=merge, retry_seconds=0.01
    )
    w.start()
    w.add(Row("a", {"state": 1, "offset": 10}))
    with pytest.raises(RuntimeError):
        await w.flush()
    w.add(Row("a", {"state": 2}))
    await w.flush()
    assert applied == {"a": {"state": 2, "offset": 10}}  # newer values win, nothing lost
    await w.close()


async def test_close_waits_for_the_write_in_flight_then_drains() -> None:
    store = Store()
    store.gate = asyncio.Event()
    w = BatchWriter("t", store.write, limit=100, batch_size=2)
    w.start()
    for i in range(5):
        w.add(i)
    await store.writing.wait()
    closing = asyncio.create_task(w.close())
    await asyncio.sleep(0.01)
    assert not closing.done()  # it never cancels the commit under way
    store.gate.set()
    await closing
    assert store.rows == [0, 1, 2, 3, 4]


async def test_a_cancelled_flush_does_not_cancel_the_write() -> None:
    store = Store()
    store.gate = asyncio.Event()
    w = BatchWriter("t", store.write, limit=100)
    w.start()
    w.add(1)
    waiting = asyncio.create_task(w.flush())
    await store.writing.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    store.gate.set()
    await w.flush()
    assert store.rows == [1]
    await w.close()


async def test_close_on_a_broken_store_gives_up_once() -> None:
    store = Store()
    store.fail_next = 1_000_000
    w = BatchWriter("t", store.write, limit=100, retry_seconds=60)
    w.start()
    w.add(1)
    await store.writing.wait()
    await asyncio.wait_for(w.close(), 5)  # logged, not retried forever
    assert w.pending == 1 and store.rows == []


async def test_flush_without_a_running_writer_writes_itself() -> None:
    store = Store()
    w = BatchWriter("t", store.write, limit=100)
    w.add(1)
    await w.flush()
    w.start()
    w.add(2)
    await w.close()
    w.add(3)  # after close (late shutdown work): a flush still stores it
    await w.flush()
    assert store.rows == [1, 2, 3]


async def test_backlog_and_drops_are_metrics() -> None:
    from agentic_sandbox.broker.observability.metrics import Metrics, provide_writer_metrics

    store = Store()
    metrics = Metrics()
    w = BatchWriter("event-writer", store.write, limit=2)
    provide_writer_metrics(metrics, [w])
    for i in range(3):
        w.add(i)
    text = metrics.exposition().decode()
    assert 'sandbox_write_behind_pending{writer="event-writer"} 2.0' in text
    assert 'sandbox_write_behind_dropped_total{writer="event-writer"} 1.0' in text


class Tables:
    """A fake database for a `WriteGroup`: each transaction's writes, committed together or
    not at all; can fail a commit (after it stored the rows, as a lost answer, or not)."""

    def __init__(self) -> None:
        self.commits: list[list[tuple[str, list[int]]]] = []
        self.fail_next = 0
        self.lose_answer = False  # the failing commit stored its rows all the same
        self.gate: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[list[tuple[str, list[int]]]]:
        tx: list[tuple[str, list[int]]] = []
        yield tx
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            if self.lose_answer:
                self.commits.append(tx)
            raise RuntimeError("database is locked")
        self.commits.append(tx)

    def rows(self, table: str) -> list[int]:
        return [r for tx in self.commits for name, b in tx if name == table for r in b]


def member(tables: Tables, group: WriteGroup, name: str, **kw: object) -> BatchWriter[int]:
    async def write_in(tx: list[tuple[str, list[int]]], batch: list[int]) -> None:
        tx.append((name, list(batch)))

    return BatchWriter(name, write_in=write_in, group=group, limit=1000, **kw)  # type: ignore[arg-type]


async def test_a_group_writes_its_members_waiting_batches_in_one_transaction() -> None:
    tables = Tables()
    group = WriteGroup(tables.begin)
    events, audit = member(tables, group, "events"), member(tables, group, "audit")
    events.start()
    audit.start()
    events.add(1)
    audit.add(10)
    events.add(2)
    await asyncio.gather(events.flush(), audit.flush())
    assert tables.commits == [[("events", [1, 2]), ("audit", [10])]]  # one, not two
    assert group.commits == 1
    audit.add(11)  # alone: a transaction of its own
    await audit.flush()
    assert tables.commits[-1] == [("audit", [11])]
    await events.close()
    await audit.close()


async def test_a_failed_group_commit_puts_every_batch_back_in_order() -> None:
    tables = Tables()
    tables.fail_next = 1
    group = WriteGroup(tables.begin)
    events = member(tables, group, "events", retry_seconds=0.01)
    audit = member(tables, group, "audit", retry_seconds=0.01)
    events.start()
    audit.start()
    tables.gate = asyncio.Event()  # the commit waits until both callers wait for it
    events.add(1)
    audit.add(10)
    flushes = asyncio.gather(events.flush(), audit.flush(), return_exceptions=True)
    await asyncio.sleep(0.01)
    tables.gate.set()
    results = await flushes
    assert [type(r) for r in results] == [RuntimeError, RuntimeError]  # both hear of it
    events.add(2)
    for w in (events, audit):
        async with asyncio.timeout(5):
            while True:
                try:
                    await w.flush()
                    break
                except RuntimeError:
                    continue
    assert tables.rows("events") == [1, 2]
    assert tables.rows("audit") == [10]  # once each: nothing lost, nothing twice
    await events.close()
    await audit.close()


async def test_a_lost_commit_answer_counts_as_stored_for_the_whole_group() -> None:
    tables = Tables()
    tables.fail_next = 1
    tables.lose_answer = True
    group = WriteGroup(tables.begin)
    seen: list[list[int]] = []

    async def stored_anyway(batch: list[int]) -> bool:
        return tables.rows("events")[-len(batch) :] == batch

    events = member(
        tables,
        group,
        "events",
        prepare=lambda b: [x * 100 for x in b],  # what is written (numbered, say)
        stored=seen.append,
        stored_anyway=stored_anyway,
    )
    audit = member(tables, group, "audit")
    events.start()
    audit.start()
    events.add(1)
    audit.add(10)
    await asyncio.gather(events.flush(), audit.flush())  # no error: it was stored
    assert tables.rows("events") == [100]
    assert tables.rows("audit") == [10]  # not written a second time
    assert seen == [[100]]
    await events.close()
    await audit.close()


async def test_a_member_adding_during_a_group_write_follows_it() -> None:
    tables = Tables()
    tables.gate = asyncio.Event()
    group = WriteGroup(tables.begin)
    events, audit = member(tables, group, "events"), member(tables, group, "audit")
    events.start()
    audit.start()
    events.add(1)
    audit.add(10)
    await asyncio.sleep(0.01)  # the first transaction waits at its commit
    audit.add(11)
    events.add(2)
    tables.gate.set()
    await asyncio.gather(events.flush(), audit.flush())
    assert tables.commits == [
        [("events", [1]), ("audit", [10])],
        [("events", [2]), ("audit", [11])],
    ]
    await events.close()
    await audit.close()


def test_a_writer_writes_alone_or_in_a_group() -> None:
    async def write_in(conn: object, batch: list[int]) -> None:
        return None

    with pytest.raises(ValueError, match="alone"):
        BatchWriter("t", limit=1)  # neither
    with pytest.raises(ValueError, match="alone"):
        BatchWriter("t", Store().write, write_in=write_in, limit=1)  # both
    with pytest.raises(ValueError, match="alone"):
        BatchWriter("t", write_in=write_in, limit=1)  # no group to write in
