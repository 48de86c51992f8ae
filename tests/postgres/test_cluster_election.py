"""Leader election and fencing on a real PostgreSQL, in process: two electors, one leader; the
winner's lock connection killed → the other leads at the next term; an old term's write is
refused and stores nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import create_async_engine

from agentic_sandbox.broker.auth.service import AuthService
from agentic_sandbox.broker.auth.streams import LiveStreams
from agentic_sandbox.broker.cluster import Elector, Fenced, NodeInfo, Role
from agentic_sandbox.broker.store import Database, models

FAST = {"poll_seconds": 0.05, "watchdog_seconds": 0.2, "watchdog_timeout": 1.0}


def node(name: str) -> NodeInfo:
    return NodeInfo(name, f"http://127.0.0.1:1/{name}", f"127.0.0.1:2/{name}", "test")


async def until(cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def dbs(pg_url: str) -> AsyncIterator[tuple[Database, Database]]:
    a, b = Database(pg_url), Database(pg_url)
    await asyncio.gather(a.migrate(), b.migrate())  # two nodes migrating at once
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def stored_term(db: Database) -> int:
    async with db.session() as s:
        return int(await s.scalar(select(models.ControlTerm.term)) or 0)


async def kv_count(db: Database, key: str) -> int:
    async with db.session() as s:
        return int(
            await s.scalar(
                select(func.count()).select_from(models.KeyValue).where(models.KeyValue.key == key)
            )
            or 0
        )


async def test_concurrent_migrations_reach_head(dbs: tuple[Database, Database]) -> None:
    a, b = dbs
    assert await a.current_revision() == await b.current_revision() == Database.head_revision()
    assert await stored_term(a) == 0


async def test_two_bootstraps_make_one_admin_token(
    dbs: tuple[Database, Database], tmp_path: Path
) -> None:
    a, b = dbs
    auths = [AuthService(db, LiveStreams(max_per_credential=4)) for db in (a, b)]

    async def boot(auth: AuthService, db: Database) -> Path | None:
        async with db.exclusively():
            return await auth.ensure_bootstrap_admin(tmp_path / "admin-token")

    made = await asyncio.gather(boot(auths[0], a), boot(auths[1], b))
    assert sorted(m is not None for m in made) == [False, True]
    async with a.session() as s:
        assert await s.scalar(select(func.count()).select_from(models.OperatorToken)) == 1


async def test_two_electors_one_leader_then_failover(
    dbs: tuple[Database, Database], pg_url: str
) -> None:
    a, b = dbs
    ea, eb = Elector(a, node("n1"), **FAST), Elector(b, node("n2"), **FAST)
    lost: list[str] = []
    for e in (ea, eb):
        e.on_lost(lost.append)
    await asyncio.gather(ea.start(), eb.start())
    admin = create_async_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(ea.elected()), asyncio.ensure_future(eb.elected())],
            timeout=30,
            return_when=asyncio.FIRST_COMPLETED,
        )
        assert done, "nobody was elected"
        winner, other = (ea, eb) if ea.role is Role.leader else (eb, ea)
        wdb = a if winner is ea else b
        assert winner.role is Role.leader and winner.term == 1 and wdb.fence == 1
        # the other keeps polling as a follower and names the winner
        await until(lambda: other.leader is not None)
        assert other.role is Role.follower and other.leader.node == winner.me.node  # type: ignore[union-attr]
        await asyncio.sleep(0.3)  # several more polls: still one leader
        assert other.role is Role.follower and winner.role is Role.leader

        # the winner's lock connection dies (as when its host vanishes)
        assert winner.backend_pid is not None
        async with admin.connect() as conn:
            await conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": winner.backend_pid})
        t0 = time.monotonic()
        await asyncio.wait_for(other.elected(), 30)
        took = time.monotonic() - t0  # (how fast is for the benchmark, not a test)
        assert other.role is Role.leader and other.term == 2, (other.role, other.term, took)
        assert await stored_term(a) == 2
        # the old winner notices (its watchdog) and steps down
        await until(lambda: bool(lost))
        assert winner.role is Role.follower and len(lost) == 1
        async with a.session() as s:
            row = (await s.execute(select(models.ControlTerm))).scalar_one()
            nodes = {n.name: n.role for n in (await s.scalars(select(models.ControlNode))).all()}
        assert row.leader_node == other.me.node and row.leader_http_url == other.me.url
        assert nodes[other.me.node] == "leader"
    finally:
        try:
            await ea.stop()
        finally:
            await eb.stop()
            await admin.dispose()


async def test_old_term_writes_are_fenced(dbs: tuple[Database, Database]) -> None:
    a, b = dbs
    a.fence = 1
    async with a.session() as s:  # term 0 in the database: n1's term 1 was never taken
        pass  # a transaction that wrote nothing is not checked
    with pytest.raises(Fenced):
        async with a.session() as s:
            s.add(models.KeyValue(key="never-stored", value={}))
    assert await kv_count(b, "never-stored") == 0

    async with b.session() as s:
        await s.execute(update(models.ControlTerm).values(term=1))
    async with a.session() as s:  # the leader's own term: stored
        s.add(models.KeyValue(key="stored", value={}))
    assert await kv_count(b, "stored") == 1

    # a transaction open across the next leader's term bump: refused at commit
    with pytest.raises(Fenced) as info:
        async with a.session() as s:
            s.add(models.KeyValue(key="across-bump", value={}))
            await s.flush()
            async with b.session() as s2:
                await s2.execute(update(models.ControlTerm).values(term=2))
    assert info.value.mine == 1 and info.value.current == 2
    assert await kv_count(b, "across-bump") == 0

    # the Core path (Database.begin, the task store's writes) is fenced the same way
    with pytest.raises(Fenced):
        async with a.begin() as conn:
            await conn.execute(
                models.KeyValue.__table__.insert().values(
                    key="core-write", value={}, updated_at=models.utcnow()
                )
            )
    assert await kv_count(b, "core-write") == 0
