"""SQLite: one server per data dir, always its leader; `server.lock` refuses a second one."""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

from agentic_sandbox.broker.cluster.state import LeaderInfo, NodeInfo, Role

LOCK_FILE = "server.lock"


class DataDirBusy(Exception):
    """Another server holds the data dir; the message names it."""


class DataDirLock:
    """An exclusive `flock` on `<data_dir>/server.lock`, held for the process's lifetime (the
    kernel drops it when the process dies, however it dies). The file says who holds it."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, me: NodeInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DataDirBusy(
                f"the data dir {self.path.parent} is in use by another sandbox-server "
                f"({holder}; it holds {self.path}). On SQLite one server owns a data dir: "
                "stop that one, use another SANDBOX_DATA_DIR, or share a PostgreSQL "
                "(SANDBOX_DATABASE_URL) to run several nodes"
            ) from None
        doc = {
            "node": me.node,
            "pid": os.getpid(),
            "url": me.url,
            "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(doc) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        doc = {}
    if not isinstance(doc, dict) or not doc.get("node"):
        return "holder unknown"
    return (
        f"node {doc.get('node')}, pid {doc.get('pid')}, {doc.get('url')}, since {doc.get('since')}"
    )


class SingleNode:
    """The leadership of a lone server: it leads from the start, with no term and no fence."""

    def __init__(self, me: NodeInfo, data_dir: Path) -> None:
        self.me = me
        self._lock = DataDirLock(data_dir)

    @property
    def role(self) -> Role:
        return Role.single

    @property
    def term(self) -> int | None:
        return None

    @property
    def leader(self) -> LeaderInfo | None:
        return LeaderInfo(self.me.node, self.me.url, self.me.grpc)

    @property
    def previous_leader(self) -> str | None:
        return None

    def on_lost(self, fn: Callable[[str], None]) -> None:
        pass  # never lost

    async def start(self) -> None:
        self._lock.acquire(self.me)

    async def elected(self) -> None:
        return None

    async def stop(self) -> None:
        self._lock.release()
