"""Alembic environment: runs on the connection the server (or a test) hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from agentic_sandbox.broker.store.models import Base

target_metadata = Base.metadata


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "migrations run through broker.store (sandbox-server migrates at start-up); "
        "use `sandbox-server migrate` rather than the alembic command"
    )
run_migrations(connection)
