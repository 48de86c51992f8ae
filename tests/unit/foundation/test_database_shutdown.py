"""The SQLite store lets the event loop end after queries were cancelled twice.

A task cancelled once mid-statement and again while SQLAlchemy closes the invalidated
connection (a shutdown cancels what is running; a caller's own timeout may cancel it too) left a
task behind that waited forever, so `asyncio.run` — the server's exit after SIGTERM, the
tests' event loop — never returned (seen as a 600 s teardown hang in CI).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from sqlalchemy import text

from agentic_sandbox.broker.store.db import Database

SLOW = text(
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 2000000) "
    "SELECT count(*) FROM r"
)


async def _cancel_queries_twice_then_close(db: Database, rounds: int) -> int:
    async def slow() -> None:
        async with db.engine.connect() as conn:
            await conn.execute(SLOW)

    for _ in range(rounds):
        task = asyncio.create_task(slow())
        await asyncio.sleep(0.05)  # the statement runs in aiosqlite's thread
        task.cancel()
        await asyncio.sleep(0.02)  # SQLAlchemy is closing the invalidated connection
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await db.close()
    again = Database(db.url)  # the file is still a database
    try:
        async with again.engine.connect() as conn:
            return int((await conn.execute(text("SELECT 1"))).scalar_one())
    finally:
        await again.close()


def test_the_event_loop_ends_after_queries_cancelled_twice(tmp_path: Path) -> None:
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    result: list[int] = []

    def run() -> None:
        async def main() -> None:
            result.append(await _cancel_queries_twice_then_close(Database(db_url), rounds=4))

        asyncio.run(main())

    # A daemon thread: if the loop never ends, the test fails instead of hanging the run.
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert result == [1], "the queries' task did not finish"
    assert not thread.is_alive(), "asyncio.run did not return: a task was left waiting forever"
