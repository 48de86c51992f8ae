"""Shared state of a `Fleet`: hosts, the instance index, events, the executor.

The index is a cache of libvirt's truth (each instance's record lives in its domain's
``<metadata>``); it is rebuilt by reconciliation and kept current by lifecycle events.
Each concern adds its operations as a mixin over `FleetBase` (lifecycle, snapshots, clones,
warm pool, reconciliation, hosts); `fleet.service.Fleet` puts them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import libvirt

from .connection import CallObserver, HostConnection
from .errors import NotFound
from .events import CrashLoopDetector, EventCallback, EventSink
from .models import (
    FleetConfig,
    FleetEvent,
    FleetEventKind,
    Instance,
    InstanceRecord,
    InstanceState,
    SavedState,
)

log = logging.getLogger(__name__)

FaultHook = Callable[[str], None]
"""Test seam: called with a stage name before each step of a multi-step operation; raising
there simulates a failure at that step."""

StageObserver = Callable[[str], None]
_stage_observer: ContextVar[StageObserver | None] = ContextVar("fleet_stage_observer", default=None)


@contextmanager
def observe_stages(observer: StageObserver) -> Iterator[None]:
    """Within this block (same task), ``observer(stage)`` is called as each step of a
    multi-step operation (create, clone, pool take) begins: placing, ports, disk, seed,
    defining, booting, restoring, … — so the layer above can time its stages."""
    token = _stage_observer.set(observer)
    try:
        yield
    finally:
        _stage_observer.reset(token)


@dataclass
class Entry:
    record: InstanceRecord
    state: InstanceState
    uuid: str = ""
    reason: str = ""
    deleting: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)


class FleetBase:
    def __init__(
        self,
        config: FleetConfig | None = None,
        *,
        on_event: EventCallback | None = None,
        fault_hook: FaultHook | None = None,
        on_call: CallObserver | None = None,
    ) -> None:
        self.on_call = on_call
        self.config = config or FleetConfig()
        self.events = EventSink(on_event)
        self.crash_detector = CrashLoopDetector(
            self.config.crash_loop_threshold, self.config.crash_loop_window_s
        )
        self.hosts: dict[str, HostConnection] = {}
        self.entries: dict[str, Entry] = {}
        self.saved_states: dict[str, SavedState] = {}
        self.state_locks: dict[str, asyncio.Lock] = {}
        self.inflight: set[tuple[str, str]] = set()
        # placement reads committed resources and claims a host in one step
        self.placement_lock = asyncio.Lock()  # (host, domain) being made or removed
        self.executor = ThreadPoolExecutor(
            max_workers=self.config.executor_workers, thread_name_prefix="fleet-libvirt"
        )
        self._fault_hook = fault_hook
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ------------------------------------------------------------------ plumbing

    def fault(self, stage: str) -> None:
        observer = _stage_observer.get()
        if observer is not None:
            observer(stage)
        if self._fault_hook is not None:
            self._fault_hook(stage)

    def emit(self, kind: FleetEventKind, **kw: Any) -> None:
        self.events.emit(FleetEvent(kind=kind, **kw))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        # Background work (pool refills, restarts) must not report its steps to whoever
        # happened to be observing stages when it was started.
        ctx = contextvars.copy_context()
        ctx.run(_stage_observer.set, None)
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

    def host(self, name: str) -> HostConnection:
        try:
            return self.hosts[name]
        except KeyError:
            raise NotFound(f"no host {name!r}") from None

    def entry(self, instance_id: str) -> Entry:
        try:
            return self.entries[instance_id]
        except KeyError:
            raise NotFound(f"no instance {instance_id!r}") from None

    def entry_by_domain(self, host: str, name: str, uuid: str = "") -> Entry | None:
        for e in self.entries.values():
            if e.record.host == host and (e.record.domain == name or (uuid and e.uuid == uuid)):
                return e
        return None

    def view(self, e: Entry) -> Instance:
        return Instance(record=e.record.model_copy(deep=True), state=e.state, state_reason=e.reason)

    def set_state(self, e: Entry, state: InstanceState, reason: str = "") -> None:
        if e.state == state:
            e.reason = reason or e.reason
            return
        e.state = state
        e.reason = reason
        kind = {
            InstanceState.LOST: FleetEventKind.INSTANCE_LOST,
        }.get(state, FleetEventKind.INSTANCE_STATE_CHANGED)
        self.emit(
            kind, host=e.record.host, instance_id=e.record.instance_id, state=state, detail=reason
        )

    async def lookup_domain(self, e: Entry) -> libvirt.virDomain:
        h = self.host(e.record.host)
        conn, _ = h.require()

        def find() -> libvirt.virDomain:
            if e.uuid:
                try:
                    return conn.lookupByUUIDString(e.uuid)
                except libvirt.libvirtError as err:
                    if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                        raise
            return conn.lookupByName(e.record.domain)

        return await h.run(find)

    def state_lock(self, state_id: str) -> asyncio.Lock:
        return self.state_locks.setdefault(state_id, asyncio.Lock())

    def busy_states(self) -> set[str]:
        """States being captured, restored from or deleted right now."""
        return {s for s, lock in self.state_locks.items() if lock.locked()}

    async def collect_frozen_disks(self, h: HostConnection) -> list[str]:
        """Remove the frozen disks of deleted states that nothing on ``h`` is backed by any
        more (see `disks.HostStorage.collect_frozen_disks`)."""
        if h.storage is None:
            return []
        removed = await h.run(h.storage.collect_frozen_disks, self.busy_states())
        for name in removed:
            log.info("host %s: removed %s (its state is deleted and nothing uses it)", h.name, name)
        return removed

    async def reconcile_host(self, host: HostConnection) -> Any:  # provided by ReconcileOps
        raise NotImplementedError
