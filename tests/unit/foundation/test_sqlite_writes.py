"""SQLite on the loop's own thread (`store/sqlite_inline.py`) with this process's writers
queued on a lock (`store/sqlite_writer.py`): a second writer waits for the first without
SQLite's sleeping busy handler and without stalling the event loop; a writer that waits too
long gets "database is locked"; a failed transaction frees the lock; no driver thread runs.
A real SQLite file with the real migrations.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, OperationalError

from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store.db import Database


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'writes.db'}")
    await database.migrate()
    yield database
    await database.close()


async def _owners(db: Database) -> list[str]:
    async with db.session() as s:
        return list((await s.scalars(select(m.Instance.id).order_by(m.Instance.id))).all())


async def test_a_second_writer_waits_for_the_first_without_stalling_the_loop(
    db: Database,
) -> None:
    first_wrote = asyncio.Event()
    release_first = asyncio.Event()
    committed: list[tuple[str, float]] = []

    async def first() -> None:
        async with db.session() as s:
            s.add(m.Instance(id="vm-a", owner="alice"))
            await s.flush()  # its INSERT has run: it holds SQLite's write lock
            first_wrote.set()
            await release_first.wait()
        committed.append(("a", time.monotonic()))

    async def second() -> None:
        await first_wrote.wait()
        async with db.session() as s:
            s.add(m.Instance(id="vm-b", owner="bob"))
        committed.append(("b", time.monotonic()))

    gaps: list[float] = []

    async def ticker() -> None:  # the loop keeps running other work meanwhile
        last = time.monotonic()
        while not release_first.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tasks = [asyncio.create_task(c()) for c in (first, second, ticker)]
    await first_wrote.wait()
    await asyncio.sleep(0.3)
    assert not committed, "the second writer went ahead of the first's transaction"
    release_first.set()
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    assert [c for c, _ in committed] == ["a", "b"]
    # the second writer started when the lock freed, not at a busy handler's next poll
    assert committed[1][1] - committed[0][1] < 0.05
    assert gaps and max(gaps) < 0.1, f"the event loop stalled for {max(gaps):.3f} s"
    assert db.serial_writer is not None and db.serial_writer.waits >= 1
    assert await _owners(db) == ["vm-a", "vm-b"]


async def test_a_writer_that_waits_too_long_is_told_the_database_is_locked(
    db: Database,
) -> None:
    if db.serial_writer is not None:
        db.serial_writer.wait_seconds = 0.2
    async with db.session() as outer:
        outer.add(m.Instance(id="vm-a", owner="alice"))
        await outer.flush()
        # a write from another transaction while this one holds the lock: as with SQLite's
        # own busy timeout, it fails after the wait rather than hanging
        started = time.monotonic()
        with pytest.raises(OperationalError, match="database is locked"):
            async with db.session() as inner:
                inner.add(m.Instance(id="vm-b", owner="bob"))
        assert time.monotonic() - started < 2
    # the lock was not leaked by either transaction
    async with db.session() as s:
        s.add(m.Instance(id="vm-c", owner="carol"))
    assert await _owners(db) == ["vm-a", "vm-c"]


async def test_a_failed_transaction_frees_the_lock(db: Database) -> None:
    async with db.session() as s:
        s.add(m.Instance(id="vm-a", owner="alice"))
    with pytest.raises(IntegrityError):
        async with db.session() as s:
            s.add(m.Instance(id="vm-a", owner="mallory"))  # the same primary key
    async with asyncio.timeout(2):  # would wait out the lock if the rollback kept it
        async with db.begin() as conn:
            await conn.execute(m.Instance.__table__.insert().values(id="vm-b", owner="bob"))
    assert await _owners(db) == ["vm-a", "vm-b"]


async def test_no_driver_thread_runs_however_many_connections_are_open(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'threads.db'}")
    try:
        await db.migrate()
        opened = asyncio.Event()
        held = 0

        async def hold(i: int) -> None:  # three sessions open at once: three connections
            nonlocal held
            async with db.session() as s:
                await s.execute(select(m.Instance.id))
                held += 1
                if held == 3:
                    opened.set()
                await opened.wait()
                s.add(m.Instance(id=f"vm-{i}", owner="alice"))

        async with asyncio.timeout(10):
            await asyncio.gather(*(hold(i) for i in range(3)))
        started = {t.name for t in threading.enumerate() if t.ident not in before}
        # the one thread: checkpoints, which wait for the disk, are kept off the loop
        assert started == {"sqlite-checkpoint"}, f"database calls started {sorted(started)}"
    finally:
        await db.close()
    assert not [t for t in threading.enumerate() if t.name == "sqlite-checkpoint"]


async def test_commits_never_checkpoint_and_the_checkpointer_does(
    db: Database, tmp_path: Path
) -> None:
    """A checkpoint syncs the disk (15-330 ms measured on a busy one): never on the loop.
    Until a checkpoint, new pages live in the write-ahead log only, so the database file's
    size tells whether one ran."""
    assert db.checkpointer is not None
    await asyncio.to_thread(db.checkpointer.stop)
    main_file = tmp_path / "writes.db"
    size = main_file.stat().st_size
    for i in range(30):  # well past SQLite's default autocheckpoint of 1000 pages
        async with db.session() as s:
            s.add(m.Instance(id=f"vm-{i}", owner="alice", spec={"pad": "x" * 200_000}))
    assert main_file.stat().st_size == size, "a commit checkpointed on the loop's thread"
    db.checkpointer.interval = 0.05
    db.checkpointer.start()
    async with asyncio.timeout(10):
        while main_file.stat().st_size == size or db.checkpointer.runs < 1:
            await asyncio.sleep(0.02)
