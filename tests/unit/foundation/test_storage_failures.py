"""Storage failures are recognised through the driver's wrapping, and named without driver
text for clients."""

from __future__ import annotations

import errno
import sqlite3

from agentic_sandbox.broker.store.health import storage_failure


def test_storage_failures_are_recognised_through_wrapping() -> None:
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]
    wrapped = RuntimeError("commit failed")
    wrapped.__cause__ = full
    failure = storage_failure(wrapped)
    assert failure is not None and failure.kind == "full"
    enospc = storage_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert enospc is not None and enospc.kind == "full"
    erofs = storage_failure(OSError(errno.EROFS, "Read-only file system"))
    assert erofs is not None and erofs.kind == "read-only"

    class PgError(Exception):
        sqlstate = "53100"

    pg = storage_failure(PgError("could not extend file"))
    assert pg is not None and pg.kind == "full" and "could not" not in pg.public
    assert storage_failure(ValueError("nope")) is None
