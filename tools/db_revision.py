"""Generate an Alembic migration from the models: `.venv/bin/python tools/db_revision.py "msg"`.

It upgrades a scratch SQLite database to head, then autogenerates the difference between it and
`broker.store.models`. Review the result (and check it on PostgreSQL: the postgres test tier runs
every migration up and down).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from alembic import command
from sqlalchemy.engine import Connection

from agentic_sandbox.broker.store.db import Database, alembic_config


async def main(message: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(f"sqlite+aiosqlite:///{Path(tmp) / 'scratch.db'}")

        def run(conn: Connection) -> None:
            cfg = alembic_config(conn)
            command.upgrade(cfg, "head")
            command.revision(cfg, message=message, autogenerate=True)

        async with db.engine.begin() as conn:
            await conn.run_sync(run)
        await db.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tools/db_revision.py MESSAGE")
    asyncio.run(main(sys.argv[1]))
