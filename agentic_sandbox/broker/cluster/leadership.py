"""PostgreSQL leadership: an advisory lock elects, the `control_term` row fences.

Every node polls `pg_try_advisory_lock(ELECTION_KEY)` on a connection of its own. The winner
bumps `control_term.term` (naming itself) on that same connection and sets `Database.fence` to
the new term, so each of its write transactions checks the term before it commits. The lock
lives as long as that connection: a `kill -9`, or the connection's end, frees it at once, and
a follower takes it on its next poll. The leader runs a watchdog query on the connection; when
it fails (or a write is fenced) the node has lost leadership and says so through `on_lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable

from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import NullPool

from agentic_sandbox.broker.cluster.state import LeaderInfo, NodeInfo, Role
from agentic_sandbox.broker.store import Database, Fenced, models

log = logging.getLogger(__name__)

ELECTION_KEY = 0x5A4D_0002  # the leadership lock (MIGRATE_LOCK_KEY is 0x5A4D_0001)
TERM = models.ControlTerm
NODES = models.ControlNode


class Elector:
    def __init__(
        self,
        db: Database,
        me: NodeInfo,
        *,
        key: int = ELECTION_KEY,
        poll_seconds: float = 0.25,
        watchdog_seconds: float = 1.0,
        watchdog_timeout: float = 2.0,
        heartbeat_seconds: float = 1.0,
    ) -> None:
        self.me = me
        self._db = db
        self._key = key
        self._poll = poll_seconds
        self._watchdog = watchdog_seconds
        self._watchdog_timeout = watchdog_timeout
        self._heartbeat_every = heartbeat_seconds
        # Its own connection, never pooled: the lock is this connection's. The server side's
        # keepalives end it soon after this host vanishes, which frees the lock.
        self._engine = create_async_engine(
            db.url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={
                "server_settings": {
                    "application_name": f"sandbox-elector:{me.node}"[:63],
                    "tcp_keepalives_idle": "2",
                    "tcp_keepalives_interval": "1",
                    "tcp_keepalives_count": "2",
                }
            },
        )
        self._conn: AsyncConnection | None = None
        self._role = Role.follower
        self._term: int | None = None
        self._leader: LeaderInfo | None = None
        self._previous: str | None = None
        self._elected = asyncio.Event()
        self._lost_callbacks: list[Callable[[str], None]] = []
        self._lost = False
        self._task: asyncio.Task[None] | None = None
        self._last_heartbeat = 0.0
        self._started_at = dt.datetime.now(dt.UTC)
        self._complained = False
        self.backend_pid: int | None = None  # the lock connection's server process
        db.on_fenced = self._fenced

    # ---- what the server reads ------------------------------------------------------------
    @property
    def role(self) -> Role:
        return self._role

    @property
    def term(self) -> int | None:
        return self._term

    @property
    def leader(self) -> LeaderInfo | None:
        return self._leader

    @property
    def previous_leader(self) -> str | None:
        return self._previous

    def on_lost(self, fn: Callable[[str], None]) -> None:
        self._lost_callbacks.append(fn)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"elector:{self.me.node}")

    async def elected(self) -> None:
        await self._elected.wait()

    async def stop(self) -> None:
        """Unlock (a follower takes over at once) and close. Call after the last write."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("the elector failed")
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                if self._role is Role.leader:
                    await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
            with contextlib.suppress(Exception):
                await conn.close()
        self._db.fence = None
        await self._engine.dispose()

    # ---- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                if await self._campaign():
                    break
                self._complained = False
            except Exception as exc:
                await self._drop_connection()
                self._leader = None
                if not self._complained:
                    log.warning("leader election: the database is unreachable: %s", exc)
                    self._complained = True
            await asyncio.sleep(self._poll)
        log.info(
            "this node leads (term %s)",
            self._term,
            extra={"node": self.me.node, "term": self._term},
        )
        self._elected.set()
        await self._watch()

    async def _connection(self) -> AsyncConnection:
        if self._conn is None:
            self._conn = await self._engine.connect()
            self.backend_pid = (await self._conn.execute(text("SELECT pg_backend_pid()"))).scalar()
        return self._conn

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _campaign(self) -> bool:
        """One poll: take the lock (and the next term), or learn who leads. True: we lead."""
        conn = await self._connection()
        got = (
            await conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self._key})
        ).scalar()
        if got:
            # the lock is ours: nothing else writes the row between this read and the bump
            before = (
                await conn.execute(select(TERM.leader_node).where(TERM.id == 1))
            ).scalar_one_or_none()
            self._previous = before or None
            term = (
                await conn.execute(
                    update(TERM)
                    .where(TERM.id == 1)
                    .values(
                        term=TERM.term + 1,
                        leader_node=self.me.node,
                        leader_http_url=self.me.url,
                        leader_grpc=self.me.grpc,
                        since=dt.datetime.now(dt.UTC),
                    )
                    .returning(TERM.term)
                )
            ).scalar_one()
            self._term = int(term)
            self._db.fence = self._term
            self._role = Role.leader
            self._leader = LeaderInfo(self.me.node, self.me.url, self.me.grpc)
            await self._heartbeat(conn, force=True)
            return True
        row = (
            await conn.execute(
                select(TERM.term, TERM.leader_node, TERM.leader_http_url, TERM.leader_grpc).where(
                    TERM.id == 1
                )
            )
        ).one_or_none()
        if row is None or not row.leader_node or row.leader_node == self.me.node:
            self._leader = None  # nobody has led yet, or the row still names us (a restart)
        else:
            self._leader = LeaderInfo(row.leader_node, row.leader_http_url, row.leader_grpc or "")
            self._term = int(row.term)
        await self._heartbeat(conn)
        return False

    async def _heartbeat(self, conn: AsyncConnection, *, force: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if not force and loop.time() - self._last_heartbeat < self._heartbeat_every:
            return
        self._last_heartbeat = loop.time()
        now = dt.datetime.now(dt.UTC)
        values = {
            "http_url": self.me.url,
            "grpc_address": self.me.grpc,
            "version": self.me.version,
            "role": self._role.value,
            "seen_at": now,
        }
        stmt = pg_insert(NODES).values(name=self.me.node, started_at=self._started_at, **values)
        await conn.execute(stmt.on_conflict_do_update(index_elements=[NODES.name], set_=values))

    async def _watch(self) -> None:
        while not self._lost:  # (a fenced write also ends it)
            await asyncio.sleep(self._watchdog)
            try:
                conn = await self._connection_alive()
                async with asyncio.timeout(self._watchdog_timeout):
                    await self._heartbeat(conn)
            except Exception as exc:
                self._lose(f"the leadership lock's connection failed ({type(exc).__name__}: {exc})")
        # Whatever state the lock is in, let it go: another node may lead at once.
        await self._drop_connection()

    async def _connection_alive(self) -> AsyncConnection:
        conn = self._conn
        if conn is None:
            raise ConnectionError("no lock connection")
        async with asyncio.timeout(self._watchdog_timeout):
            await conn.execute(text("SELECT 1"))
        return conn

    def _fenced(self, exc: Fenced) -> None:
        self._lose(str(exc))

    def _lose(self, reason: str) -> None:
        if self._lost:
            return
        self._lost = True
        self._db.fence = self._term if self._term is not None else -1  # stays fenced
        self._role = Role.follower
        self._leader = None
        log.error("this node lost leadership of term %s: %s", self._term, reason)
        for fn in self._lost_callbacks:
            try:
                fn(reason)
            except Exception:
                log.exception("a leadership-lost hook failed")
