"""Write-behind: callers hand rows over without waiting; one task writes them in batches.

A `BatchWriter` is the one write-behind loop of the server (the event log, the audit log, the
session hub's row updates). What it promises:

- **Bounded.** At most `limit` items wait (queued plus the batch being written). When full,
  the oldest item *not being written* is dropped and counted in `dropped` (`on_drop` hears of
  it); a batch in flight is never dropped.
- **Ordered.** Batches are written one at a time, in the order items were added, by the
  writer's own task. Nothing else writes, so a caller that is cancelled (a request whose
  client left, a shutdown) can never cancel a commit half-way.
- **Merged where asked.** With `merge_key`/`merge`, an item whose key already waits (and is
  not yet being written) is folded into the waiting one in place: one row update per key per
  batch instead of one per call.
- **Grouped, where asked.** Writers that join a `WriteGroup` share its transactions: the one
  that writes first takes the batches the others have waiting along, each written by its own
  `write_in(conn, batch)`, all committed at once (or none). The server's writers (events,
  audit, session rows) are one group: an A2A task's run wrote 13 transactions, of which the
  group makes 7; an exec's audit entry and event are one.
- **Retried, never lost or reordered.** A batch whose write fails goes back to the front of the
  queue as it was, and is tried again after `retry_seconds` (at once when someone flushes).
- **Flushed on stop.** `close()` lets the writer finish the batch it is writing, then drain
  what is queued, then end; it never cancels the writer. A store that still refuses the
  writes at that point is logged once, not retried forever.

`flush()` returns once everything added before the call is stored, and raises the error of
the write that failed if one does meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BatchWriter(Generic[T]):
    def __init__(
        self,
        name: str,
        write: Callable[[list[T]], Awaitable[None]] | None = None,
        *,
        limit: int,
        write_in: Callable[[Any, list[T]], Awaitable[None]] | None = None,
        group: WriteGroup | None = None,
        batch_size: int = 500,
        retry_seconds: float = 1.0,
        merge_key: Callable[[T], Hashable] | None = None,
        merge: Callable[[T, T], None] | None = None,
        on_drop: Callable[[T], None] | None = None,
        prepare: Callable[[list[T]], list[T]] | None = None,
        stored: Callable[[list[T]], None] | None = None,
        stored_anyway: Callable[[list[T]], Awaitable[bool]] | None = None,
    ) -> None:
        """`write(batch)` stores a batch in one transaction (all or nothing) or raises; or,
        in a `group`, `write_in(conn, batch)` adds a batch to the group's transaction.
        `merge(waiting, new)` folds `new` into `waiting` (same `merge_key`) in place.
        `prepare(batch)` gives what is written (at each try), `stored(prepared)` hears of
        each commit, and `stored_anyway(prepared)` tells, after a commit failed, whether it
        was stored all the same (its answer lost with the connection): then it counts as
        stored instead of being tried again."""
        if (merge_key is None) != (merge is None):
            raise ValueError("merge_key and merge go together")
        if limit < 1 or batch_size < 1:
            raise ValueError("limit and batch_size must be positive")
        if (write is None) == (write_in is None) or (write_in is None) != (group is None):
            raise ValueError("a writer either writes alone (write) or in a group (write_in)")
        self.name = name
        self._write = write
        self._write_in = write_in
        self._group = group
        self._prepare = prepare
        self._stored = stored
        self._stored_anyway = stored_anyway
        self._limit = limit
        self._batch_size = min(batch_size, limit)
        self._retry_seconds = retry_seconds
        self._merge_key = merge_key
        self._merge = merge
        self._on_drop = on_drop
        self._queue: deque[T] = deque()  # waiting, oldest first
        self._inflight = 0  # items of the batch being written (taken off the queue)
        self._waiting: dict[Hashable, T] = {}  # merge key -> its item in the queue
        # Positions count items in the order they were added: every item before `_done` is
        # stored (or was dropped), and `_added` is the position of the next one.
        self._added = 0
        self._done = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()  # something was added, or the writer should stop
        self._kick = asyncio.Event()  # someone waits: retry a failed batch now
        self._inline = asyncio.Lock()  # flushes while no writer task runs
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.dropped = 0
        if group is not None:
            group.join(self)

    @property
    def pending(self) -> int:
        """Items not yet stored (waiting and in flight)."""
        return len(self._queue) + self._inflight

    def add(self, item: T) -> None:
        """Queue `item` (or fold it into the waiting item with its key); never waits."""
        key: Hashable = None
        if self._merge_key is not None:
            key = self._merge_key(item)
            waiting = self._waiting.get(key)
            if waiting is not None:
                assert self._merge is not None
                self._merge(waiting, item)
                return
        if len(self._queue) + self._inflight >= self._limit:
            if not self._queue:  # all of it is in flight, which is never dropped
                self._dropped(item)
                return
            old = self._queue.popleft()
            self._forget(old)
            self._dropped(old)
        if self._merge_key is not None:
            self._waiting[key] = item
        self._queue.append(item)
        self._added += 1
        self._wake.set()

    def _dropped(self, item: T) -> None:
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(item)

    def _forget(self, item: T) -> None:
        if self._merge_key is not None:
            key = self._merge_key(item)
            if self._waiting.get(key) is item:
                del self._waiting[key]

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def flush(self) -> None:
        """Return once everything added so far is stored; raise if a write fails first."""
        if self._task is None or self._task.done():
            async with self._inline:
                while self._queue:
                    await self._write_next()
            return
        target = self._added
        if self._done >= target:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((target, waiter))
        self._kick.set()
        self._wake.set()
        await waiter  # a cancelled caller stops waiting; the write goes on

    async def close(self) -> None:
        """Write what is queued, then stop the writer (never cancelled mid-write)."""
        task = self._task
        if task is None or task.done():
            try:
                await self.flush()
            except Exception:
                log.exception("%s: final flush failed", self.name)
            return
        self._stopping = True
        self._wake.set()
        self._kick.set()
        await asyncio.shield(task)

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._write_next()
            except Exception:
                if self._stopping:
                    log.exception("%s: final flush failed", self.name)
                    return
                log.exception("%s: writing a batch failed; retrying", self.name)
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._retry_seconds):
                        await self._kick.wait()

    async def _write_next(self) -> None:
        """Write the oldest batch; on failure it goes back to the front of the queue."""
        if self._group is not None:
            await self._group.write(self)
            return
        assert self._write is not None
        batch, end = self._take()
        ready = self.prepared(batch)
        try:
            await self._write(ready)
        except BaseException as exc:
            if not (isinstance(exc, Exception) and await self.was_stored(ready)):
                self._put_back(batch, exc)
                raise
        self._committed(ready, end)

    # ---- one batch's steps (the group drives them for its members) ------------------------
    def _take(self) -> tuple[list[T], int]:
        """The oldest batch, now in flight, and the position it ends at."""
        size = min(self._batch_size, len(self._queue))
        batch = [self._queue.popleft() for _ in range(size)]
        for item in batch:
            self._forget(item)  # a newer value for its key queues behind it, not into it
        self._inflight = size
        return batch, self._added - len(self._queue)

    def prepared(self, batch: list[T]) -> list[T]:
        return batch if self._prepare is None else self._prepare(batch)

    async def was_stored(self, ready: list[T]) -> bool:
        """After a failed commit: whether this batch was stored all the same."""
        if self._stored_anyway is None:
            return False
        try:
            stored = await self._stored_anyway(ready)
        except Exception:
            return False
        if stored:
            log.warning("%s: a batch was stored though its commit failed", self.name)
        return stored

    def _put_back(self, batch: list[T], exc: BaseException) -> None:
        self._queue.extendleft(reversed(batch))
        self._inflight = 0
        if isinstance(exc, Exception):
            self._settle(exc)

    def _committed(self, ready: list[T], end: int) -> None:
        self._inflight = 0
        self._done = end
        if self._stored is not None:
            self._stored(ready)
        self._settle(None)

    def _settle(self, failure: Exception | None) -> None:
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for target, waiter in self._waiters:
            if waiter.done():
                continue
            if failure is not None:
                waiter.set_exception(failure)
            elif target <= self._done:
                waiter.set_result(None)
            else:
                keep.append((target, waiter))
        self._waiters = keep


class WriteGroup:
    """Write-behind writers that share transactions. Whichever member writes first takes the
    batches the others have waiting along (members in the order they joined, each batch in
    its writer's order), in one transaction from `begin()`: all stored, or all put back at
    the front of their queues (each member then retries on its own). One member writes at a
    time, so a member's batches still commit in order."""

    def __init__(self, begin: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self._begin = begin
        self._members: list[BatchWriter[Any]] = []
        self._lock = asyncio.Lock()
        self.commits = 0  # transactions committed

    def join(self, writer: BatchWriter[Any]) -> None:
        self._members.append(writer)

    async def write(self, first: BatchWriter[Any]) -> None:
        async with self._lock:
            if not first._queue:
                return  # another member's write took this one's batch along meanwhile
            taken = []
            for w in self._members:
                if w._queue:
                    batch, end = w._take()
                    taken.append((w, batch, w.prepared(batch), end))
            try:
                async with self._begin() as conn:
                    for w, _, ready, _ in taken:
                        assert w._write_in is not None
                        await w._write_in(conn, ready)
            except BaseException as exc:
                stored = False
                if isinstance(exc, Exception):
                    for w, _, ready, _ in taken:
                        if w._stored_anyway is not None and await w.was_stored(ready):
                            stored = True  # one member's rows are there: the commit was
                            break
                if not stored:
                    for w, batch, _, _ in taken:
                        w._put_back(batch, exc)
                        if w is not first:
                            w._wake.set()  # it retries on its own
                    raise
            self.commits += 1
            for w, _, ready, end in taken:
                w._committed(ready, end)
