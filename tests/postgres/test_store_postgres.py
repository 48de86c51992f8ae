"""The store on a real PostgreSQL: migrations up/down, models match, the server runs on it."""

from __future__ import annotations

from pathlib import Path

from agentic_sandbox.broker.store import Database
from tests.integration.foundation.test_migrations import check_models_match, check_up_down
from tests.support.inproc_server import make_settings, start_server


async def test_postgres_up_and_down(pg_url: str) -> None:
    db = Database(pg_url)
    try:
        assert db.dialect == "postgresql"
        await check_up_down(db)
    finally:
        await db.close()


async def test_postgres_models_match_migrations(pg_url: str) -> None:
    db = Database(pg_url)
    try:
        await check_models_match(db)
    finally:
        await db.close()


async def test_server_on_postgres(pg_url: str, tmp_path: Path) -> None:
    async with start_server(make_settings(tmp_path, database_url=pg_url)) as r:
        status, ready, _ = await r.call("GET", "/readyz")
        assert status == 200 and ready["checks"]["database"]["detail"] == "postgresql"
        alice = await r.make_token("alice", "operator")
        status, _body, _ = await r.call(
            "PUT", "/api/v2/admin/secrets/PG_SECRET", token=alice, json={"value": "pg-secret-xyz"}
        )
        assert status == 201
        for i in range(300):
            r.svc.events.publish("host.added", host=f"h{i % 3}", data={"i": i})
        await r.svc.events.flush()
        status, page, _ = await r.call("GET", "/api/v1/events?after=0&limit=200&type=host.added")
        assert status == 200 and len(page["items"]) == 200
        status, audit, _ = await r.call("GET", "/api/v2/admin/audit?subject_type=secret")
        assert [e["action"] for e in audit["items"]] == ["secret.create"]
        assert "pg-secret-xyz" not in str(audit)
