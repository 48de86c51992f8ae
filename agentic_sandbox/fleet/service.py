"""`Fleet`: the asynchronous face of the fleet, for the server and for scripts.

Usage::

    async with Fleet(FleetConfig(data_dir=...), on_event=print) as fleet:
        await fleet.open([HostSpec(name="local", uri="qemu:///system")])
        await fleet.import_image("debian-12", "/path/to/base.qcow2")
        inst = await fleet.create(InstanceSpec(instance_id="dev-1", image="debian-12"))
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType

from .clones import CloneOps
from .core import Entry
from .hosts import HostOps
from .kvm_probe import AccelReport
from .libvirt_loop import LoopBridge
from .lifecycle import LifecycleOps
from .models import HostSpec, InstanceRecord, InstanceState
from .reconcile import ReconcileOps
from .snapshots import SnapshotOps
from .warm_pool import WarmPoolOps


class Fleet(HostOps, LifecycleOps, SnapshotOps, CloneOps, WarmPoolOps, ReconcileOps):
    """All methods are coroutines run on one asyncio loop; libvirt's blocking calls run in a
    bounded thread pool and its events are dispatched on that loop."""

    async def open(
        self, hosts: Iterable[HostSpec] | None = None, known: Iterable[InstanceRecord] = ()
    ) -> None:
        """Attach libvirt's events to the running loop, load ``known`` records (the server's
        mirror, so instances whose domain vanished while the fleet was down show as ``lost``),
        connect ``hosts`` (default: one host ``local`` at ``config.default_uri``) and
        reconcile each."""
        LoopBridge.attach(asyncio.get_running_loop())
        for rec in known:
            self.entries.setdefault(
                rec.instance_id,
                Entry(record=rec, state=InstanceState.UNKNOWN, reason="not yet reconciled"),
            )
        specs = (
            list(hosts)
            if hosts is not None
            else [HostSpec(name="local", uri=self.config.default_uri)]
        )
        for spec in specs:
            await self.add_host(spec)

    async def close(self) -> None:
        """Stop background work and disconnect. Instances keep running."""
        if self._closed:
            return
        self._closed = True
        for slot in getattr(self, "pools", {}).values():
            if slot.refill is not None:
                slot.refill.cancel()
        await self.cancel_tasks()
        for h in list(self.hosts.values()):
            await h.close()
        await asyncio.sleep(0)  # let deferred libvirt handle removals run on this loop
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def accel(self, host: str) -> AccelReport | None:
        """Which accelerator guests on ``host`` use and why (KVM probe result)."""
        return self.host(host).accel
