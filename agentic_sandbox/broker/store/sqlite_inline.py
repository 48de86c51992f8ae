"""aiosqlite connections that run each call on the event loop's own thread.

aiosqlite gives every connection a thread and sends it each call — cursor, execute, fetch,
close, commit, rollback — as its own round trip: a queue put that wakes the thread, and a
`call_soon_threadsafe` that wakes the loop with the answer. An A2A task through this server
made about 90 such round trips, while SQLite's own work for it was 3-4 ms (its statements take
tens of microseconds here: a local file, WAL, `synchronous=NORMAL`, so a commit does not wait
for the disk). Run inline, with the write-behind changes of the same commit, the server's CPU
per task fell from 42-48 ms to 24-29 ms (bench_a2a's one-client loop, interleaved rounds, on a
machine another test run shared).

`InlineConnection` is aiosqlite's own `Connection` (so SQLAlchemy's aiosqlite dialect drives
it unchanged) whose call queue runs each call at once, on the caller's thread, and resolves its
future before it is awaited; no thread is started. What this relies on:

- no in-process writer ever meets another one's lock, which would make SQLite's busy handler
  sleep on the loop's thread while the holder cannot run: `sqlite_writer.SerialWriter` queues
  this process's writers on a FIFO lock on the loop first;
- statements are short, and none waits for the disk: with `synchronous=NORMAL` only a WAL
  checkpoint syncs, and that took 15-330 ms here on a busy disk. So these connections never
  checkpoint (`wal_autocheckpoint=0`); a `Checkpointer` thread with its own connection runs
  a PASSIVE checkpoint (it neither waits for nor blocks writers or readers) once a second.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import aiosqlite

log = logging.getLogger(__name__)

#: seconds between two checkpoints of the write-ahead log
CHECKPOINT_SECONDS = 1.0


class _RunAtOnce:
    """Stands in for aiosqlite's call queue: runs the call now and settles its future."""

    def put_nowait(self, item: tuple[asyncio.Future[Any] | None, Callable[[], Any]]) -> None:
        future, function = item
        try:
            result = function()
        except BaseException as exc:  # handed to the awaiting caller, as aiosqlite does
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(result)


class InlineConnection(aiosqlite.Connection):
    def __init__(self, connector: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(connector, iter_chunk_size=64)
        self._tx = _RunAtOnce()  # type: ignore[assignment]

    def __await__(self) -> Any:
        return self._connect().__await__()  # no thread to start


def _open(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA wal_autocheckpoint=0")  # the Checkpointer's job, off the loop
    # After the log restarts, cut it to what its first commit wrote: without this, a log grown
    # by migrations or a burst keeps free room that lets writes succeed on a full disk (and
    # then fail later, at random), instead of failing at once with "storage full" (507)
    conn.execute("PRAGMA journal_size_limit=0")
    return conn


def connector(path: str, checkpointer: Checkpointer) -> Callable[[], Any]:
    """An `async_creator` for `create_async_engine`: a new inline connection to `path`."""

    async def connect() -> InlineConnection:
        checkpointer.start()
        return await InlineConnection(lambda: _open(path))

    return connect


class Checkpointer:
    """A thread that checkpoints the database's write-ahead log every `interval` seconds."""

    def __init__(self, path: str, interval: float = CHECKPOINT_SECONDS) -> None:
        self.path = path
        self.interval = interval
        self.runs = 0  # checkpoints that ran
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread (after the checkpoint it may be running); `start` makes a new one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None
        self._stop.clear()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while not self._stop.wait(self.interval):
                try:
                    if conn is None:
                        conn = sqlite3.connect(self.path, check_same_thread=False)
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.runs += 1
                    self._failing = False
                except sqlite3.Error as exc:  # the log grows meanwhile; writes go on
                    if not self._failing:
                        log.warning("checkpointing %s failed: %s", self.path, exc)
                    self._failing = True
        finally:
            if conn is not None:
                conn.close()
