"""Engine, sessions and migrations for SQLite (default, WAL) and PostgreSQL (asyncpg).

Fencing (several control hosts on one PostgreSQL, see `broker/cluster/`): while `fence` holds
the leader's term, every transaction that wrote reads the `control_term` row `FOR SHARE` just
before it commits and raises `Fenced` (rolled back, nothing stored) if the term has moved on. A
new leader's term bump waits for the old term's committing writers, and once it has committed
no old-term commit can land.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, text
from sqlalchemy.engine import Connection
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import ORMExecuteState, Session, UOWTransaction
from sqlalchemy.pool import ConnectionPoolEntry

from agentic_sandbox.broker.store import sqlite_inline
from agentic_sandbox.broker.store.batch import WriteGroup
from agentic_sandbox.broker.store.health import StorageFailure, storage_failure
from agentic_sandbox.broker.store.rowcache import RowCache, TableWrites
from agentic_sandbox.broker.store.sqlite_writer import SerialWriter

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")

#: PostgreSQL advisory-lock key under which nodes migrate and bootstrap one at a time.
MIGRATE_LOCK_KEY = 0x5A4D_0001
#: how long a SQLite writer waits for another (in this process: `sqlite_writer.py`) to finish
BUSY_SECONDS = 5.0
FENCE_SQL = text("SELECT term FROM control_term WHERE id = 1 FOR SHARE")


class Fenced(Exception):
    """A write of a leader whose term has passed: rolled back, nothing stored."""

    def __init__(self, mine: int, current: int | None) -> None:
        super().__init__(
            f"this node led term {mine} but the database is at term {current}; "
            "the write was not stored"
        )
        self.mine = mine
        self.current = current


def alembic_config(connection: Connection | None = None) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _sqlite_connected(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    _stop_at_most_once(dbapi_conn.driver_connection)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={int(BUSY_SECONDS * 1000)}")
    cur.close()


def _stop_at_most_once(driver: Any) -> None:
    """Make an aiosqlite connection's ``stop()`` do nothing after its first call.

    A query cancelled twice — once mid-statement, once while SQLAlchemy closes the invalidated
    connection — makes SQLAlchemy stop the aiosqlite thread while its shielded graceful
    ``close()`` still runs; that ``close()`` ends with a second ``stop()`` whose future is
    queued behind the first one's sentinel, after the thread has left, and it waits forever. A
    task waiting forever keeps ``asyncio.run`` (the server's exit after SIGTERM) from
    returning. (SQLAlchemy 2.1 with aiosqlite 0.22.)"""
    first_stop = driver.stop
    stopped = False

    def stop() -> Any:
        nonlocal stopped
        if stopped:
            return None  # aiosqlite's close() waits on the future only when there is one
        stopped = True
        return first_stop()

    driver.stop = stop


def _private_sqlite_file(path: Path) -> None:
    """The database (audit, events, session commands, artifacts) is its owner's only: made
    0600 before SQLite opens it — SQLite gives its WAL and SHM files the database's mode — and
    put back to 0600 (with the WAL and SHM) if an older run left it readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if f.stat().st_mode & 0o077:
                os.chmod(f, 0o600)


class _Session(Session):
    """Remembers (in `info["wrote"]`) whether the transaction wrote anything."""


@event.listens_for(_Session, "after_flush")
def _flushed(session: Session, _flush: UOWTransaction) -> None:
    session.info["wrote"] = True


@event.listens_for(_Session, "do_orm_execute")
def _executed(state: ORMExecuteState) -> None:
    if state.is_insert or state.is_update or state.is_delete:
        state.session.info["wrote"] = True


class Database:
    """One async engine plus a session factory. `async with db.session() as s:` commits on exit."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dialect = url.split("+", 1)[0].split(":", 1)[0]
        kwargs: dict[str, Any] = {}
        self.checkpointer: sqlite_inline.Checkpointer | None = None
        if self.dialect == "sqlite":
            # no liveness ping per checkout: a local file's connection does not go stale, and
            # the ping is one more round trip to the driver's thread on every session
            path = url.split(":///", 1)[1] if ":///" in url else ""
            if path and path != ":memory:":
                _private_sqlite_file(Path(path))
                # each call on the loop's thread, not a round trip to a driver thread; the
                # log's checkpoints (which wait for the disk) in a thread of their own
                self.checkpointer = sqlite_inline.Checkpointer(path)
                kwargs["async_creator"] = sqlite_inline.connector(path, self.checkpointer)
        else:
            kwargs.update(pool_pre_ping=True, pool_size=10, max_overflow=20)
        self.engine: AsyncEngine = create_async_engine(url, **kwargs)
        # the write-behind writers (events, audit, session rows) share its transactions
        self.write_behind = WriteGroup(self.begin)
        # What this process wrote, per table: read-only views (`rowcache.py`) are served from
        # memory only where this process is the one writer (SQLite: one server per data dir)
        self.writes: TableWrites | None = None
        self.serial_writer: SerialWriter | None = None
        if self.dialect == "sqlite":
            event.listen(self.engine.sync_engine, "connect", _sqlite_connected)
            self.writes = TableWrites(self.engine.sync_engine)
            self.serial_writer = SerialWriter(self.engine.sync_engine, BUSY_SECONDS)
        self.sessions = async_sessionmaker(
            self.engine, expire_on_commit=False, sync_session_class=_Session
        )
        # Monotonic times of the last committed write, and of the last write that failed for
        # lack of storage (with what failed): readiness compares them (store/health.py).
        self.last_write_ok = 0.0
        self.last_storage_failure: tuple[float, StorageFailure] | None = None
        # The leader's term while this node leads (PostgreSQL only); None: writes unfenced.
        self.fence: int | None = None
        # Called once per fenced write (the server steps down on the first).
        self.on_fenced: Callable[[Fenced], None] | None = None
        # Read-only views of rows by table (`rowcache.py`), made by their users.
        self.row_caches: dict[str, RowCache[Any]] = {}

    async def _check_fence(self, conn: AsyncConnection | AsyncSession) -> None:
        mine = self.fence
        if mine is None:
            return
        current = (await conn.execute(FENCE_SQL)).scalar()
        if current != mine:
            exc = Fenced(mine, current)
            if self.on_fenced is not None:
                self.on_fenced(exc)
            raise exc

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        try:
            async with self.sessions() as s:
                async with s.begin():
                    yield s
                    if self.fence is not None:
                        await s.flush()
                        if s.info.get("wrote"):
                            await self._check_fence(s)
                if s.info.pop("wrote", False):
                    self.last_write_ok = time.monotonic()
        except Exception as exc:
            failure = storage_failure(exc)
            if failure is not None:
                self.last_storage_failure = (time.monotonic(), failure)
                log.error("a database write failed: %s", failure.message)
            raise

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        """A Core connection in a write transaction: fenced, committed on exit, rolled back on
        an exception (the one way to write outside `session()`)."""
        async with self.engine.begin() as conn:
            yield conn
            await self._check_fence(conn)
        self.last_write_ok = time.monotonic()

    @asynccontextmanager
    async def exclusively(self, key: int = MIGRATE_LOCK_KEY) -> AsyncIterator[None]:
        """One node at a time (a PostgreSQL advisory lock held on its own connection); on
        SQLite one server owns the data dir anyway."""
        if self.dialect == "sqlite":
            yield
            return
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            await conn.commit()
            try:
                yield
            finally:
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                await conn.commit()

    async def probe_write(self) -> None:
        """A real committed write that changes nothing: alembic_version's one row rewritten
        with its own value (it still needs space, on SQLite and PostgreSQL alike)."""
        async with self.session() as s:
            await s.execute(text("UPDATE alembic_version SET version_num = version_num"))
            s.info["wrote"] = True

    async def ping(self) -> None:
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def migrate(self, revision: str = "head") -> None:
        """Upgrade (or downgrade, for a revision below the current one) the schema."""

        def run(connection: Connection) -> None:
            cfg = alembic_config(connection)
            current = MigrationContext.configure(connection).get_current_revision()
            script = ScriptDirectory.from_config(cfg)
            if revision == "base" or (
                revision != "head"
                and current is not None
                and revision in {r.revision for r in script.iterate_revisions(current, "base")}
            ):
                command.downgrade(cfg, revision)
            else:
                command.upgrade(cfg, revision)

        async with self.exclusively(), self.engine.begin() as conn:
            await conn.run_sync(run)

    async def current_revision(self) -> str | None:
        def get(connection: Connection) -> str | None:
            return MigrationContext.configure(connection).get_current_revision()

        async with self.engine.connect() as conn:
            return await conn.run_sync(get)

    @staticmethod
    def head_revision() -> str:
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        assert head is not None
        return head

    async def close(self) -> None:
        await self.engine.dispose()
        if self.checkpointer is not None:
            await asyncio.to_thread(self.checkpointer.stop)
