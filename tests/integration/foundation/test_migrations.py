"""Migrations go up and down on SQLite, and the models match the migrations."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store.models import Base

EXPECTED_TABLES = {
    "hosts",
    "images",
    "instances",
    "snapshots",
    "loadouts",
    "loadout_versions",
    "sessions",
    "tasks",
    "runs",
    "task_events",
    "events",
    "operator_tokens",
    "api_keys",
    "enrollment_tokens",
    "secrets",
    "push_configs",
    "idempotency_keys",
    "audit_log",
    "operations",
}


async def tables(db: Database) -> set[str]:
    def names(conn: Connection) -> set[str]:
        return set(inspect(conn).get_table_names()) - {"alembic_version"}

    async with db.engine.connect() as conn:
        return await conn.run_sync(names)


async def check_up_down(db: Database) -> None:
    await db.migrate("head")
    assert await db.current_revision() == Database.head_revision()
    assert await tables(db) >= EXPECTED_TABLES
    await db.migrate("base")
    assert await db.current_revision() is None
    assert await tables(db) == set()
    await db.migrate("head")
    assert await tables(db) >= EXPECTED_TABLES


async def check_models_match(db: Database) -> None:
    def diff(conn: Connection) -> list[object]:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, Base.metadata))

    await db.migrate("head")
    async with db.engine.connect() as conn:
        changes = await conn.run_sync(diff)
    assert changes == [], f"models differ from migrations (run tools/db_revision.py): {changes}"


async def test_sqlite_up_and_down(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    try:
        await check_up_down(db)
    finally:
        await db.close()


async def test_models_match_migrations(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    try:
        await check_models_match(db)
    finally:
        await db.close()


async def test_sqlite_uses_wal(tmp_path: Path) -> None:
    from sqlalchemy import text

    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'w.db'}")
    try:
        async with db.engine.connect() as conn:
            mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar()
        assert mode == "wal"
    finally:
        await db.close()


async def test_a_drain_kept_as_a_label_becomes_the_draining_column(tmp_path: Path) -> None:
    """Hosts drained before 0005 kept `_draining` in their labels: after the upgrade the
    column says so and the label is gone (the other labels stay); a downgrade puts it back."""
    import json

    from sqlalchemy import text

    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'd.db'}")
    try:
        await db.migrate("0004")
        async with db.engine.begin() as conn:
            for name, labels in (
                ("far", {"net": "far", "_draining": True}),
                ("near", {"net": "near"}),
            ):
                await conn.execute(
                    text(
                        "INSERT INTO hosts (name, uri, labels, state, state_reason, owner,"
                        " created_at, updated_at) VALUES (:n, 'test:///default', :l, 'unknown',"
                        " '', 'admin', '2026-12-01 00:00:00', '2026-12-01 00:00:00')"
                    ),
                    {"n": name, "l": json.dumps(labels)},
                )
        await db.migrate("head")

        async def rows() -> dict[str, tuple[object, ...]]:
            async with db.engine.connect() as conn:
                result = await conn.execute(text("SELECT * FROM hosts ORDER BY name"))
                return {
                    r.name: tuple(r._mapping.get(k) for k in ("labels", "draining")) for r in result
                }

        got = await rows()
        assert json.loads(str(got["far"][0])) == {"net": "far"} and got["far"][1] in (1, True)
        assert json.loads(str(got["near"][0])) == {"net": "near"} and got["near"][1] in (0, False)
        await db.migrate("0004")
        async with db.engine.connect() as conn:
            labels = (
                await conn.execute(text("SELECT labels FROM hosts WHERE name='far'"))
            ).scalar()
        assert json.loads(str(labels)) == {"net": "far", "_draining": True}
    finally:
        await db.close()
