"""The fleet's ear on its hosts (`driver.HostListener`): lifecycle events update instance
states at once, crashes are counted (restart, or stop restarting in a crash loop), a host that
drops makes its instances ``unknown``, and one that comes back is reconciled.

Events arrive on the loop's thread. An event for a domain the index does not know, defined
outside any operation of this fleet, triggers a reconciliation shortly after (adoption).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .context import FleetContext
from .driver import DomainEvent, DomainEventKind, HostDriver
from .errors import FleetError
from .events import CrashLoopDetector
from .index import Entry, InstanceIndex
from .lifecycle import lookup, power_on
from .models import DOMAIN_PREFIX, CrashRecord, FleetEventKind, InstanceState, utcnow
from .reconcile import Reconciler

log = logging.getLogger(__name__)


class Monitor:
    def __init__(self, ctx: FleetContext, index: InstanceIndex, reconciler: Reconciler) -> None:
        self._ctx = ctx
        self._index = index
        self._reconciler = reconciler
        config = ctx.config
        self.crash_detector = CrashLoopDetector(
            config.crash_loop_threshold, config.crash_loop_window_s
        )

    def on_domain_event(self, host: HostDriver, event: DomainEvent) -> None:
        e = self._index.by_domain(host.name, event.domain, event.uuid)
        if e is None:
            if (
                event.domain.startswith(DOMAIN_PREFIX)
                and event.kind is DomainEventKind.DEFINED
                and not self._index.busy(host.name, event.domain)
            ):
                self._ctx.spawn(self._adopt_later(host))
            return
        if e.deleting:
            return
        if event.kind is DomainEventKind.UNDEFINED:
            if not self._index.busy(host.name, e.record.domain):
                self._index.set_state(e, InstanceState.LOST, "domain undefined outside the fleet")
            return
        if event.state is None:
            return
        self._index.set_state(e, event.state, event.why)
        if event.crashed:
            self._ctx.spawn(self._handle_crash(host, e, event.why))

    async def _adopt_later(self, host: HostDriver) -> None:
        await asyncio.sleep(0.05)
        await self._reconciler.reconcile_host(host)

    async def _handle_crash(self, host: HostDriver, e: Entry, why: str) -> None:
        config = self._ctx.config
        now = utcnow()
        keep = config.crash_loop_threshold * 2
        record = e.record.model_copy(
            update={"crashes": [*e.record.crashes, CrashRecord(at=now, reason=why)][-keep:]}
        )
        e.record = record
        self._ctx.emit(
            FleetEventKind.INSTANCE_CRASHED,
            host=record.host,
            instance_id=record.instance_id,
            incarnation=record.incarnation,
            state=InstanceState.CRASHED,
            detail=why,
        )
        loop_detected = self.crash_detector.is_loop(record.crashes, now)
        with contextlib.suppress(FleetError):
            dom = await lookup(host, e)
            await dom.set_record(record)
        if loop_detected:
            n = len(self.crash_detector.recent(record.crashes, now))
            e.reason = f"crash loop: {n} crashes in {config.crash_loop_window_s:g}s"
            self._ctx.emit(
                FleetEventKind.INSTANCE_CRASH_LOOP,
                host=record.host,
                instance_id=record.instance_id,
                incarnation=record.incarnation,
                state=InstanceState.CRASHED,
                detail=e.reason + "; automatic restarts stopped",
            )
            return
        if not record.restart_on_crash:
            return
        await asyncio.sleep(config.restart_delay_s)
        async with e.lock:
            if e.deleting or e.state is not InstanceState.CRASHED:
                return
            try:
                await power_on(self._index, host, e)
            except FleetError as err:
                log.warning("restart of %s after crash failed: %s", record.instance_id, err)

    def on_disconnect(self, host: HostDriver, why: str) -> None:
        self._ctx.emit(FleetEventKind.HOST_UNREACHABLE, host=host.name, detail=why)
        for e in self._index.on_host(host.name):
            if e.state is not InstanceState.LOST:
                self._index.set_state(e, InstanceState.UNKNOWN, f"host unreachable: {why}")

    async def on_reconnect(self, host: HostDriver) -> None:
        self._ctx.emit(
            FleetEventKind.HOST_RECONNECTED,
            host=host.name,
            detail=f"connection #{host.connect_count}",
        )
        await self._reconciler.reconcile_host(host)
