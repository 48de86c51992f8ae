"""The postgres tier needs SANDBOX_TEST_POSTGRES_URL (scripts/test.sh starts a private cluster)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine


def admin_url() -> str:
    url = os.environ.get("SANDBOX_TEST_POSTGRES_URL")
    if not url:
        pytest.fail(
            "the postgres tier needs SANDBOX_TEST_POSTGRES_URL; run it through scripts/test.sh "
            "(which starts a private PostgreSQL) or set SANDBOX_SKIP_TIERS=postgres to opt out",
            pytrace=False,
        )
    return url


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    base = admin_url()
    name = "t_" + uuid.uuid4().hex[:12]
    admin = create_async_engine(base, isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.rsplit("/", 1)[0] + "/" + name
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()
