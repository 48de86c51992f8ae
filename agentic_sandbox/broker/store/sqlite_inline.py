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
  this process's writers on an asyncio lock first;
- statements are short. A WAL checkpoint (every `wal_autocheckpoint` pages, here about every
  4 MB written) writes back and syncs on the committing call.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from typing import Any

import aiosqlite


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


def connector(path: str) -> Callable[[], Any]:
    """An `async_creator` for `create_async_engine`: a new inline connection to `path`."""

    async def connect() -> InlineConnection:
        conn = InlineConnection(lambda: sqlite3.connect(path, check_same_thread=False))
        return await conn

    return connect
