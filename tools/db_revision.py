"""Generate an Alembic migration from the models.

    .venv/bin/python tools/db_revision.py "message"     a new revision on top of head
    .venv/bin/python tools/db_revision.py --initial     regenerate 0001_initial_schema.py

Until the first release there is one initial migration: a schema change regenerates it
(`--initial`) rather than adding a revision. Either way it upgrades a scratch SQLite database to
the base it builds on, then autogenerates the difference to `agentic_sandbox.broker.store.models`.
Review the result (and check it on PostgreSQL: the postgres test tier runs every migration up
and down, and a test compares models and migrations on both engines).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import tempfile
from pathlib import Path

from alembic import command
from sqlalchemy.engine import Connection

from agentic_sandbox.broker.store.db import MIGRATIONS_DIR, Database, alembic_config

INITIAL = MIGRATIONS_DIR / "versions" / "0001_initial_schema.py"


async def revise(message: str, *, initial: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(f"sqlite+aiosqlite:///{Path(tmp) / 'scratch.db'}")
        saved = Path(tmp) / INITIAL.name
        if initial:
            shutil.move(INITIAL, saved)

        def run(conn: Connection) -> None:
            cfg = alembic_config(conn)
            if not initial:
                command.upgrade(cfg, "head")
            command.revision(
                cfg, message=message, autogenerate=True, rev_id="0001" if initial else None
            )

        try:
            async with db.engine.begin() as conn:
                await conn.run_sync(run)
        except BaseException:
            if initial and saved.exists():
                shutil.move(saved, INITIAL)
            raise
        finally:
            await db.close()
        if initial:
            made = next((MIGRATIONS_DIR / "versions").glob("0001_*.py"))
            made.rename(INITIAL)
            text = INITIAL.read_text()
            INITIAL.write_text(re.sub(r"(?m)^Create Date: .*$", "Create Date: (regenerated)", text))
            print(f"regenerated {INITIAL}")


def main() -> None:
    args = sys.argv[1:]
    if args == ["--initial"]:
        asyncio.run(revise("initial schema", initial=True))
    elif len(args) == 1 and not args[0].startswith("-"):
        asyncio.run(revise(args[0], initial=False))
    else:
        sys.exit('usage: tools/db_revision.py "MESSAGE" | --initial')


if __name__ == "__main__":
    main()
