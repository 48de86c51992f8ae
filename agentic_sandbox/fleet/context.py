"""What every part of a `Fleet` shares: configuration, events, the test seam, background tasks,
and the bounded executor that blocking hypervisor calls run in."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from .events import EventCallback, EventSink
from .models import FleetConfig, FleetEvent, FleetEventKind

log = logging.getLogger(__name__)

FaultHook = Callable[[str], None]
"""Test seam: called with a stage name before each step of a multi-step operation; raising
there simulates a failure at that step."""

CallObserver = Callable[[str, float, bool], None]
"""Called after each blocking hypervisor call with (operation name, seconds, succeeded)."""

StageObserver = Callable[[str], None]
DetailObserver = Callable[[str, dict[str, Any]], None]
"""Hears (stage, facts) while a step runs, e.g. ``("uploading", {"bytes_done": …})``."""
_stage_observer: ContextVar[StageObserver | None] = ContextVar("fleet_stage_observer", default=None)
_detail_observer: ContextVar[DetailObserver | None] = ContextVar(
    "fleet_detail_observer", default=None
)


@contextmanager
def observe_stages(
    observer: StageObserver, details: DetailObserver | None = None
) -> Iterator[None]:
    """Within this block (same task), ``observer(stage)`` is called as each step of a
    multi-step operation (create, clone, pool take) begins: placing, uploading, ports, disk,
    seed, defining, booting, restoring, … — so the layer above can time its stages; and
    ``details(stage, facts)`` as a long step goes (an image upload's bytes done and total)."""
    token = _stage_observer.set(observer)
    dtoken = _detail_observer.set(details)
    try:
        yield
    finally:
        _detail_observer.reset(dtoken)
        _stage_observer.reset(token)


class FleetContext:
    def __init__(
        self,
        config: FleetConfig | None,
        on_event: EventCallback | None,
        fault_hook: FaultHook | None,
        on_call: CallObserver | None,
    ) -> None:
        """``on_event`` gets every `FleetEvent`; ``fault_hook``: see `FaultHook`; ``on_call``:
        see `CallObserver`."""
        self.config = config or FleetConfig()
        self.on_call = on_call
        self.events = EventSink(on_event)
        self.executor = ThreadPoolExecutor(
            max_workers=self.config.executor_workers, thread_name_prefix="fleet-libvirt"
        )
        self._fault_hook = fault_hook
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def fault(self, stage: str) -> None:
        """A step named ``stage`` begins: tell the stage observer, then the test seam."""
        observer = _stage_observer.get()
        if observer is not None:
            observer(stage)
        if self._fault_hook is not None:
            self._fault_hook(stage)

    def detail_observer(self) -> DetailObserver | None:
        """Who hears the facts of the step under way in this task (read it here, on the
        loop: callbacks that run elsewhere do not see the task's context)."""
        return _detail_observer.get()

    def emit(self, kind: FleetEventKind, **kw: Any) -> None:
        self.events.emit(FleetEvent(kind=kind, **kw))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        # Background work (pool refills, restarts) must not report its steps to whoever
        # happened to be observing stages when it was started.
        ctx = contextvars.copy_context()
        ctx.run(_stage_observer.set, None)
        ctx.run(_detail_observer.set, None)
        task = asyncio.get_running_loop().create_task(coro, context=ctx)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("fleet background task failed", exc_info=task.exception())

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
