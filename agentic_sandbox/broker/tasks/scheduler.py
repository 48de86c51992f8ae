"""Quotas and dispatch: which submitted task runs next.

- Admission (at submit): a task is accepted when it can run now, or when the queue of waiting
  tasks is below its bound (`task_max_pending`, `task_max_pending_per_owner`); otherwise it is
  refused (A2A: the task is created and rejected; v1: HTTP 429 with Retry-After).
- Dispatch: waiting tasks start in submission order, skipping owners at their concurrency
  limit (`task_max_running_per_owner`) while the global limit (`task_max_running`) has room.
- Claims are atomic: the run row is inserted by one INSERT … SELECT whose WHERE clause counts
  the active runs (`TaskStore.claim_run`), so the check and the claim cannot be separated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.tasks.errors import QuotaExceeded
from agentic_sandbox.broker.tasks.live import LiveTask, RunState
from agentic_sandbox.broker.tasks.states import TaskState
from agentic_sandbox.broker.tasks.store import Claim, TaskStore

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
CLAIM_RETRY_SECONDS = 1.0


class Scheduler:
    def __init__(
        self,
        *,
        store: TaskStore,
        settings: Settings,
        start_run: Callable[[LiveTask], None],
    ) -> None:
        self.store = store
        self.settings = settings
        self._start_run = start_run
        self.pending: OrderedDict[str, LiveTask] = OrderedDict()
        self.pending_by_owner: Counter[str] = Counter()
        self.reserved: Counter[str] = Counter()
        self.running_total = 0
        self.running_by_owner: Counter[str] = Counter()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        total, per_owner = await self.store.active_run_counts()
        self.running_total = total
        self.running_by_owner = Counter(per_owner)
        self._loop_task = asyncio.create_task(self._run(), name="task-scheduler")
        self.wake()

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    def wake(self) -> None:
        self._wake.set()

    # ---- admission ------------------------------------------------------------------------
    def reserve(self, owner: str) -> bool:
        """Admit one new task for `owner` (synchronous, so atomic on the loop): True when it may
        start at once (a run slot is held for it), False when it must wait (a queue place is
        held); raises QuotaExceeded when the queue is full."""
        s = self.settings
        waiting = len(self.pending) + sum(self.reserved.values())
        waiting_owner = self.pending_by_owner[owner] + self.reserved[owner]
        runs_now = (
            self.running_total + waiting < s.task_max_running
            and self.running_by_owner[owner] + waiting_owner < s.task_max_running_per_owner
        )
        if runs_now and waiting == 0:
            self.running_total += 1
            self.running_by_owner[owner] += 1
            return True
        if not runs_now:
            if waiting >= s.task_max_pending:
                raise QuotaExceeded(
                    f"{waiting} tasks are already waiting (task_max_pending={s.task_max_pending})",
                    retry_after=RETRY_AFTER_SECONDS,
                )
            if waiting_owner >= s.task_max_pending_per_owner:
                raise QuotaExceeded(
                    f"{waiting_owner} of your tasks are already waiting "
                    f"(task_max_pending_per_owner={s.task_max_pending_per_owner})",
                    retry_after=RETRY_AFTER_SECONDS,
                )
        self.reserved[owner] += 1
        return False

    def release(self, owner: str, run_now: bool) -> None:
        """Give back what `reserve` held (the task was not created, or is rejected)."""
        if run_now:
            self.running_total = max(0, self.running_total - 1)
            self.running_by_owner[owner] = max(0, self.running_by_owner[owner] - 1)
            self.wake()
        else:
            self.unreserve(owner)

    def reserve_queue(self, owner: str) -> None:
        """Hold a queue place regardless of the bound (a claim the database refused)."""
        self.reserved[owner] += 1

    def unreserve(self, owner: str) -> None:
        if self.reserved[owner] > 0:
            self.reserved[owner] -= 1

    def enqueue(self, live: LiveTask, *, reserved: bool = True) -> None:
        owner = live.record.owner
        if reserved:
            self.unreserve(owner)
        self.pending[live.id] = live
        self.pending_by_owner[owner] += 1
        self.wake()

    def dequeue(self, live: LiveTask) -> bool:
        if self.pending.pop(live.id, None) is None:
            return False
        self.pending_by_owner[live.record.owner] -= 1
        return True

    def claim_for(self, task_id: str, owner: str, run_id: str) -> Claim:
        return Claim(
            task_id=task_id,
            owner=owner,
            run_id=run_id,
            max_total=self.settings.task_max_running,
            max_owner=self.settings.task_max_running_per_owner,
        )

    def run_ended(self, live: LiveTask) -> None:
        run = live.run
        if run is None:
            self.dequeue(live)
            return
        if run.released:
            return
        run.released = True
        owner = live.record.owner
        self.running_total = max(0, self.running_total - 1)
        self.running_by_owner[owner] = max(0, self.running_by_owner[owner] - 1)
        self.wake()

    # ---- dispatch -------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._dispatch()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task dispatch failed; retrying")
                self._retry_later()

    def _retry_later(self) -> None:
        if self._retry is None:
            loop = asyncio.get_running_loop()

            def fire() -> None:
                self._retry = None
                self.wake()

            self._retry = loop.call_later(CLAIM_RETRY_SECONDS, fire)

    async def _dispatch(self) -> None:
        s = self.settings
        full_owners: set[str] = set()
        for live in list(self.pending.values()):
            if self.running_total >= s.task_max_running:
                return
            owner = live.record.owner
            if owner in full_owners:
                continue
            if self.running_by_owner[owner] >= s.task_max_running_per_owner:
                full_owners.add(owner)
                continue
            if live.record.state is not TaskState.submitted or live.id not in self.pending:
                self.dequeue(live)
                continue
            run_id = str(uuid.uuid4())
            claimed = await self.store.claim_run(self.claim_for(live.id, owner, run_id))
            if not claimed:  # the database says no (another server, or our counts drifted)
                self._retry_later()
                return
            self.dequeue(live)
            self.running_total += 1
            self.running_by_owner[owner] += 1
            live.run = RunState(id=run_id)
            if live.record.state is not TaskState.submitted:  # canceled while claiming
                self.run_ended(live)
                await self.store.update_run(
                    run_id, state="canceled", reason="canceled before start"
                )
                continue
            self._start_run(live)
