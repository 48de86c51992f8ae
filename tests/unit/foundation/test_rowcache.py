"""`RowCache` and the instance views it keeps (`store/rowcache.py`, `instances/access.py`):
served from memory until this process writes the table — by the ORM, by Core, by a delete —
and never a view read before a write that committed after it. A real SQLite database with the
real migrations; a PostgreSQL URL never caches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import delete, event, update

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.instances.access import instance_view
from agentic_sandbox.broker.instances.errors import ForbiddenError, NotFoundError
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store import rowcache
from agentic_sandbox.broker.store.db import Database
from agentic_sandbox.broker.store.rowcache import RowCache


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'rows.db'}")
    await database.migrate()
    async with database.session() as s:
        s.add(m.Instance(id="vm-1", owner="alice", spec={"budgets": {"pids": 7}}))
    yield database
    await database.close()


def _selects(db: Database) -> list[str]:
    seen: list[str] = []

    def saw(_c: object, _cur: object, statement: str, *_a: object) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    event.listen(db.engine.sync_engine, "before_cursor_execute", saw)
    return seen


def _owner_cache(db: Database) -> RowCache[str]:
    async def load(key: str) -> str | None:
        async with db.session() as s:
            row = await s.get(m.Instance, key)
        return None if row is None else row.owner

    return RowCache(db, "instances", load)


async def test_a_view_is_served_from_memory_until_the_table_is_written(db: Database) -> None:
    cache = _owner_cache(db)
    selects = _selects(db)
    assert await cache.get("vm-1") == "alice"
    read = len(selects)
    assert read >= 1
    for _ in range(5):
        assert await cache.get("vm-1") == "alice"
    assert len(selects) == read  # no database read for a current view

    async with db.session() as s:  # the ORM's unit of work
        (await s.get(m.Instance, "vm-1")).owner = "bob"  # type: ignore[union-attr]
    assert await cache.get("vm-1") == "bob"

    async with db.begin() as conn:  # Core, outside any session
        await conn.execute(update(m.Instance).where(m.Instance.id == "vm-1").values(owner="eve"))
    assert await cache.get("vm-1") == "eve"

    async with db.begin() as conn:
        await conn.execute(delete(m.Instance).where(m.Instance.id == "vm-1"))
    assert await cache.get("vm-1") is None


async def test_a_read_that_raced_a_write_is_not_served_after_the_commit(db: Database) -> None:
    """The write's statement ran before the read, its commit after: the read saw the old row
    (a write not yet committed is invisible to it) and must not outlive the commit."""
    async with db.engine.connect() as writer:
        await writer.begin()
        await writer.execute(
            update(m.Instance).where(m.Instance.id == "vm-1").values(owner="mallory")
        )
        cache = _owner_cache(db)
        assert await cache.get("vm-1") == "alice"  # the committed row, read meanwhile
        await writer.commit()
    assert await cache.get("vm-1") == "mallory"

    # the write runs while the read is under way (the loader itself writes): not kept either
    cache = _owner_cache(db)
    inner = cache._load

    async def load_then_write(key: str) -> str | None:
        seen = await inner(key)
        async with db.begin() as conn:
            await conn.execute(update(m.Instance).where(m.Instance.id == key).values(owner="zed"))
        return seen

    cache._load = load_then_write
    assert await cache.get("vm-1") == "mallory"
    cache._load = inner
    assert await cache.get("vm-1") == "zed"


async def test_a_rolled_back_write_leaves_the_row_as_it_was(db: Database) -> None:
    cache = _owner_cache(db)
    assert await cache.get("vm-1") == "alice"
    with pytest.raises(RuntimeError):
        async with db.session() as s:
            (await s.get(m.Instance, "vm-1")).owner = "bob"  # type: ignore[union-attr]
            await s.flush()
            raise RuntimeError("give up")
    assert await cache.get("vm-1") == "alice"


async def test_instance_views_keep_the_owner_checks(db: Database) -> None:
    alice = Principal(subject="alice", role=Role.operator, kind="token", credential_id="a")
    bob = Principal(subject="bob", role=Role.operator, kind="token", credential_id="b")
    view = await instance_view(db, alice, "vm-1", change=True)
    assert (view.owner, view.spec) == ("alice", {"budgets": {"pids": 7}})
    view.spec["budgets"] = {}  # every reader gets its own copy
    assert (await instance_view(db, alice, "vm-1", change=False)).spec["budgets"] == {"pids": 7}
    with pytest.raises(NotFoundError):
        await instance_view(db, bob, "vm-1", change=False)
    async with db.session() as s:  # handed to bob: the cached view must not keep alice
        (await s.get(m.Instance, "vm-1")).owner = "bob"  # type: ignore[union-attr]
    with pytest.raises(NotFoundError):
        await instance_view(db, alice, "vm-1", change=False)
    assert (await instance_view(db, bob, "vm-1", change=True)).owner == "bob"
    async with db.session() as s:  # deleted: gone at once
        (await s.get(m.Instance, "vm-1")).deleted_at = m.utcnow()  # type: ignore[union-attr]
    with pytest.raises(NotFoundError):
        await instance_view(db, bob, "vm-1", change=False)
    with pytest.raises((NotFoundError, ForbiddenError)):
        await instance_view(db, alice, "vm-1", change=True)


def test_postgresql_never_caches_unless_a_bounded_age_is_allowed() -> None:
    db = Database("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    assert db.writes is None  # other nodes write the same rows: no count is complete
    assert not RowCache(db, "instances", _never).enabled
    assert RowCache(db, "instances", _never, untracked_ttl=2.0).enabled


async def test_a_bounded_age_and_forget(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where writes are not all seen (`untracked_ttl`), a view is served for that long only;
    `forget` reads it again at once (what the process learned off the database)."""
    loads: list[str] = []

    async def load(key: str) -> str:
        loads.append(key)
        return f"view-{len(loads)}"

    cache: RowCache[str] = RowCache(db, "instances", load)
    assert await cache.get("k") == await cache.get("k") == "view-1"
    cache.forget("k")
    assert await cache.get("k") == "view-2"

    db.writes = None  # as on PostgreSQL
    clock = [100.0]
    # (the module's clock only: the event loop keeps its own)
    monkeypatch.setattr(rowcache, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    aged: RowCache[str] = RowCache(db, "instances", load, untracked_ttl=2.0)
    first = await aged.get("k")
    clock[0] += 1.9
    assert await aged.get("k") == first
    clock[0] += 0.2
    assert await aged.get("k") != first


async def _never(_key: str) -> None:
    return None


async def test_the_end_of_a_connection_that_lost_its_state_counts_for_every_table(
    db: Database,
) -> None:
    """A statement cancelled at shutdown leaves a connection whose `info` raises; its
    rollback must neither raise (that hung the server's exit) nor keep a view it may have
    changed."""
    cache = _owner_cache(db)
    assert await cache.get("vm-1") == "alice"
    before = cache.generation

    class Lost:
        invalidated = False
        closed = False

        @property
        def info(self) -> dict[str, object]:
            raise RuntimeError("Can't reconnect until invalid transaction is rolled back")

    assert db.writes is not None
    db.writes._ended(Lost())  # type: ignore[arg-type]
    assert cache.generation > before


async def test_an_instances_secrets_are_read_once_until_a_joined_table_is_written(
    db: Database, tmp_path: Path
) -> None:
    """The vault's per-instance bindings (a join of secrets, bindings and instances): each
    session start used to read them; now a write to any of the three tables ends the view."""
    from agentic_sandbox.broker.secrets.vault import Vault

    vault = Vault(db, tmp_path / "secrets.key")
    secret, _ = await vault.put("alice", "TOKEN", "one")
    async with db.session() as s:
        inst = await s.get(m.Instance, "vm-1")
        assert inst is not None
        s.add(
            m.SecretBinding(secret_id=secret.id, instance_id="vm-1", incarnation=inst.incarnation)
        )
    selects = _selects(db)
    assert await vault.values_for_instance("vm-1") == {"TOKEN": "one"}
    read = len(selects)
    assert read >= 1
    assert await vault.values_for_instance("vm-1") == {"TOKEN": "one"}
    assert len(selects) == read, "the second call read the database again"
    await vault.put("alice", "TOKEN", "two")  # the secrets table
    assert await vault.values_for_instance("vm-1") == {"TOKEN": "two"}
    async with db.session() as s:  # the instances table: a new incarnation ends the binding
        await s.execute(
            update(m.Instance).where(m.Instance.id == "vm-1").values(incarnation="f" * 32)
        )
    assert await vault.values_for_instance("vm-1") == {}
