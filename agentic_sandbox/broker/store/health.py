"""Whether the server can write: storage failures it can name, and a readiness probe.

`storage_failure(exc)` looks through an exception chain (SQLAlchemy wraps the driver's error,
which may wrap an `OSError`) and returns a `StorageFailure` when the cause is the storage
itself — a full disk or database, a read-only or failing device — so a request answers 507/503
naming it instead of a generic 500. `Database.session()` remembers the last such failure.

`StorageHealth.check()` is the `storage` readiness check. It fails while database writes fail
for lack of storage — the last such failure is newer than the last committed write — and
while a small file cannot be written, synced and removed in the data directory (recordings,
seeds and logs live there). It probes both with a real write (`Database.probe_write`) at most
every `PROBE_EVERY` seconds however often `/readyz` is asked, and every `RETRY_EVERY` seconds
while failing, so it turns ready again soon after space is freed even if nothing else writes.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentic_sandbox.broker.store.db import Database

PROBE_EVERY = 5.0
RETRY_EVERY = 1.0
PROBE_FILE = ".write-probe"  # + "-<node>": nodes sharing a data dir probe apart
PROBE_BYTES = 4096

# SQLite primary result codes (extended codes keep these in the low byte).
_SQLITE = {13: "full", 8: "read-only", 10: "io-error"}  # SQLITE_FULL, _READONLY, _IOERR
# PostgreSQL SQLSTATEs.
_POSTGRES = {"53100": "full", "53000": "full", "25006": "read-only", "58030": "io-error"}
_ERRNO = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "full",
    errno.EROFS: "read-only",
    errno.EIO: "io-error",
}
_WHAT = {
    "full": "the server's storage is full (no space left for its database or data directory)",
    "read-only": "the server's storage is read-only",
    "io-error": "the server's storage reports I/O errors",
}


@dataclass(frozen=True)
class StorageFailure:
    kind: str  # full | read-only | io-error
    cause: str  # the driver's or the OS's own words, for operators

    @property
    def public(self) -> str:
        """What a client is told (no driver text, no paths)."""
        return _WHAT[self.kind]

    @property
    def message(self) -> str:
        """What an operator is told."""
        return f"{_WHAT[self.kind]}: {self.cause}"


def storage_failure(exc: BaseException) -> StorageFailure | None:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or len(seen) > 16:
            continue
        seen.add(id(e))
        code = getattr(e, "sqlite_errorcode", None)
        if isinstance(code, int) and (code & 0xFF) in _SQLITE:
            return StorageFailure(_SQLITE[code & 0xFF], str(e))
        state = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if isinstance(state, str) and state in _POSTGRES:
            return StorageFailure(_POSTGRES[state], str(e))
        if isinstance(e, OSError) and e.errno in _ERRNO:
            return StorageFailure(_ERRNO[e.errno], e.strerror or str(e))
        orig = getattr(e, "orig", None)
        todo.extend([orig if isinstance(orig, BaseException) else None, e.__cause__, e.__context__])
    return None


class StorageHealth:
    def __init__(self, db: Database, data_dir: Path, node: str = "") -> None:
        self._db = db
        self._data_dir = data_dir
        self._probe_name = f"{PROBE_FILE}-{node}" if node else PROBE_FILE
        self._probed_at = -PROBE_EVERY
        self._file_problem = ""
        self._lock = asyncio.Lock()

    def _failing(self) -> StorageFailure | None:
        failed = self._db.last_storage_failure
        if failed is None or failed[0] <= self._db.last_write_ok:
            return None  # never failed, or a write has succeeded since
        return failed[1]

    async def check(self) -> tuple[bool, str]:
        async with self._lock:
            now = time.monotonic()
            failing = self._failing() is not None or bool(self._file_problem)
            if now - self._probed_at >= (RETRY_EVERY if failing else PROBE_EVERY):
                self._probed_at = now
                await self._probe()
            problems = []
            failure = self._failing()
            if failure is not None:
                problems.append(f"database writes fail: {failure.message}")
            if self._file_problem:
                problems.append(f"data directory writes fail: {self._file_problem}")
            if problems:
                return False, "; ".join(problems)
            return True, "database and data directory take writes"

    async def _probe(self) -> None:
        try:
            await self._db.probe_write()  # records its own success or storage failure
        except Exception as exc:
            if storage_failure(exc) is None:
                raise
        try:
            await asyncio.to_thread(self._probe_file)
            self._file_problem = ""
        except OSError as exc:
            failure = storage_failure(exc)
            self._file_problem = failure.message if failure else (exc.strerror or str(exc))

    def _probe_file(self) -> None:
        path = self._data_dir / self._probe_name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
