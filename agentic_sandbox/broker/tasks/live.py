"""Tasks that have not ended, held in memory, and their live event streams.

Every event of a task (status updates and output chunks, as A2A StreamResponse objects) is
offered to the task's subscribers as it happens. A subscriber has a bounded queue: one that
falls behind never slows the run — it is resynced with a fresh `task` snapshot instead.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentic_sandbox.broker.tasks.record import TaskRecord
from agentic_sandbox.broker.tasks.store import EventRow

StreamEvent = dict[str, Any]  # one A2A StreamResponse object


@dataclass
class RunState:
    id: str
    attempt: int = 1
    session_id: str | None = None
    offset: int = 0  # output bytes consumed from the session (decoded or held by the decoder)
    persisted_offset: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    emitted: bool = False  # an output chunk was sent (later ones append)
    cancel_requested: bool = False
    cancel_actor: str = ""
    runner: asyncio.Task[None] | None = None
    started: asyncio.Future[None] | None = None  # storing `working` (see runner._execute)
    pending_start: Any = None  # the `working` Step, until it is stored
    start_timer: asyncio.TimerHandle | None = None
    # A prompt seen before `working` was stored (the write is deferred a moment): applied then.
    early_prompt: Any = None
    advanced: asyncio.Event = field(default_factory=asyncio.Event)  # set when output arrives
    opened: asyncio.Event = field(default_factory=asyncio.Event)  # its start is over, either way
    released: bool = False  # its concurrency slot was given back
    budget: dict[str, Any] | None = None  # the run's budget (BudgetOut as JSON)

    @property
    def decoded_offset(self) -> int:
        """Offset of the first byte not yet turned into text (the decoder may hold a few)."""
        pending, _ = self.decoder.getstate()
        return self.offset - len(pending)


class Subscriber:
    def __init__(self, live: LiveTask, size: int) -> None:
        self._live = live
        self._queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue(maxsize=size)
        self.overflowed = False
        self.closed = False

    def offer(self, event: StreamEvent) -> None:
        if self.closed or self.overflowed:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True

    def end(self) -> None:
        """No more events will come (the task ended or the server stops)."""
        if self.closed:
            return
        self.closed = True
        while True:
            try:
                self._queue.put_nowait(None)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()
                self.overflowed = True

    async def next(self) -> StreamEvent | None:
        """The next event; a fresh `task` snapshot after falling behind; None at the end."""
        if self.overflowed:
            ended = False
            while not self._queue.empty():
                ended = self._queue.get_nowait() is None or ended
            self.overflowed = False
            if ended:
                self._queue.put_nowait(None)
            return self._live.record.task_event()
        return await self._queue.get()

    def close(self) -> None:
        self.closed = True
        self._live.subscribers.discard(self)


@dataclass
class LiveTask:
    record: TaskRecord
    seq: int = 0  # seq of the last event
    run: RunState | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    subscribers: set[Subscriber] = field(default_factory=set)
    unflushed: list[EventRow] = field(default_factory=list)
    output_bytes: int = 0  # UTF-8 size of the stored output (for the cap)
    truncated: bool = False  # the stored output reached the cap
    flush_handle: asyncio.TimerHandle | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    plan: Any = None  # the RunPlan, kept while the task waits for its run

    @property
    def id(self) -> str:
        return self.record.id

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def publish(self, event: StreamEvent) -> None:
        for sub in tuple(self.subscribers):
            sub.offer(event)

    def subscribe(self, size: int) -> Subscriber:
        sub = Subscriber(self, size)
        self.subscribers.add(sub)
        return sub

    def finish(self) -> None:
        for sub in tuple(self.subscribers):
            sub.end()
        self.subscribers.clear()
        self.ended.set()


class LiveTasks:
    """The registry of unfinished tasks, by task id and by run session id."""

    def __init__(self) -> None:
        self._tasks: dict[str, LiveTask] = {}
        self._by_session: dict[str, str] = {}
        self._listeners: list[Callable[[LiveTask, StreamEvent], None]] = []

    def add_listener(self, fn: Callable[[LiveTask, StreamEvent], None]) -> None:
        """Called for every event of every task (push notifications)."""
        self._listeners.append(fn)

    def emit(self, live: LiveTask, event: StreamEvent) -> None:
        live.publish(event)
        for fn in self._listeners:
            fn(live, event)

    def add(self, live: LiveTask) -> None:
        self._tasks[live.id] = live

    def get(self, task_id: str) -> LiveTask | None:
        return self._tasks.get(task_id)

    def bind_session(self, live: LiveTask, session_id: str) -> None:
        self._by_session[session_id] = live.id

    def by_session(self, session_id: str) -> LiveTask | None:
        task_id = self._by_session.get(session_id)
        return self._tasks.get(task_id) if task_id else None

    def remove(self, live: LiveTask) -> None:
        self._tasks.pop(live.id, None)
        if live.run is not None and live.run.session_id:
            self._by_session.pop(live.run.session_id, None)

    def all(self) -> list[LiveTask]:
        return list(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)
