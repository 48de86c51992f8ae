"""`Fleet`: the asynchronous face of the fleet, for the server and for scripts.

Usage::

    async with Fleet(FleetConfig(data_dir=...), on_event=print) as fleet:
        await fleet.open([HostSpec(name="local", uri="qemu:///system")])
        await fleet.import_image("debian-12", "/path/to/base.qcow2")
        inst = await fleet.create(InstanceSpec(instance_id="dev-1", image="debian-12"))

The face owns nothing but the wiring: each concern is a part that keeps its own state and is
handed the parts it talks to —

    context     FleetContext    config, events, the test seam, background tasks, executor
    index       InstanceIndex   instances by id (a cache of the hosts' truth), in-flight domains
    states      SavedStates     saved memory states, their locks and frozen disks
    reconciler  Reconciler      a host's domains -> the index (adopt, lost, orphans, states)
    monitor     Monitor         a host's events -> states, crash restarts, host loss/return
    hosts       HostRegistry    host drivers by name (libvirt's: `fleet.libvirt.LibvirtHost`)
    lifecycle   Lifecycle       create, power, delete, seed hand-off, serial log
    snapshots   Snapshots       internal snapshots
    clones      Clones          clones from saved states and from snapshots
    pools       WarmPool        paused clones kept ready per key
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType

from .clones import Clones
from .context import CallObserver, FaultHook, FleetContext
from .driver import HostDriver
from .errors import Conflict
from .events import EventCallback
from .hosts import HostRegistry
from .index import Entry, InstanceIndex
from .kvm_probe import AccelReport
from .libvirt import LibvirtHost, LoopBridge
from .lifecycle import Lifecycle
from .models import (
    FleetConfig,
    HostSpec,
    InstanceRecord,
    InstanceState,
    ReconcileReport,
    SavedState,
)
from .monitor import Monitor
from .reconcile import Reconciler
from .snapshots import Snapshots, refuse_pool_member
from .states import SavedStates
from .warm_pool import WarmPool


class Fleet:
    """All methods are coroutines run on one asyncio loop; blocking hypervisor calls run in a
    bounded thread pool and libvirt's events are dispatched on that loop."""

    def __init__(
        self,
        config: FleetConfig | None = None,
        *,
        on_event: EventCallback | None = None,
        fault_hook: FaultHook | None = None,
        on_call: CallObserver | None = None,
    ) -> None:
        ctx = self.context = FleetContext(config, on_event, fault_hook, on_call)
        self.config = ctx.config
        self.index = InstanceIndex(ctx)
        self.states = SavedStates(ctx, self.index)
        self.reconciler = Reconciler(ctx, self.index, self.states)
        self.monitor = Monitor(ctx, self.index, self.reconciler)
        self.hosts = HostRegistry(
            ctx,
            self.index,
            self.states,
            make_driver=self._libvirt_host,
            reconcile=self.reconciler.reconcile_host,
        )
        self.lifecycle = Lifecycle(ctx, self.index, self.hosts, self.states)
        self.snapshots = Snapshots(ctx, self.index, self.hosts)
        self.clones = Clones(ctx, self.index, self.hosts, self.states)
        self.pools = WarmPool(ctx, self.index, self.hosts, self.states, self.clones, self.lifecycle)

        # The public operations are the parts' own (see docs/fleet.md for the list).
        hosts, life, snaps, clones, pools = (
            self.hosts,
            self.lifecycle,
            self.snapshots,
            self.clones,
            self.pools,
        )
        self.add_host = hosts.add_host
        self.remove_host = hosts.remove_host
        self.list_hosts = hosts.list_hosts
        self.host_info = hosts.host_info
        self.set_draining = hosts.set_draining
        self.import_image = hosts.import_image

        self.create = life.create
        self.get = life.get
        self.list_instances = life.list_instances
        self.start = life.start
        self.shutdown = life.shutdown
        self.force_off = life.force_off
        self.reboot = life.reboot
        self.suspend = life.suspend
        self.resume = life.resume
        self.delete = life.delete
        self.set_seed = life.set_seed
        self.read_serial_log = life.read_serial_log

        self.create_snapshot = snaps.create_snapshot
        self.list_snapshots = snaps.list_snapshots
        self.revert_snapshot = snaps.revert_snapshot
        self.delete_snapshot = snaps.delete_snapshot

        self.list_states = self.states.list_states
        self.clone_from_state = clones.clone_from_state
        self.clone_from_snapshot = clones.clone_from_snapshot

        self.configure_pool = pools.configure_pool
        self.pool_status = pools.pool_status
        self.take_from_pool = pools.take_from_pool
        self.remove_pool = pools.remove_pool
        self.drain_pools = pools.drain_pools

    def _libvirt_host(self, spec: HostSpec) -> HostDriver:
        """A host is a driver instance: libvirt's, for every URI (the seam for other ways to
        reach a hypervisor is `HostRegistry`'s factory)."""
        ctx = self.context
        return LibvirtHost(
            spec, ctx.config, ctx.executor, listener=self.monitor, on_call=ctx.on_call
        )

    # ------------------------------------------------------------------ open / close

    async def open(
        self, hosts: Iterable[HostSpec] | None = None, known: Iterable[InstanceRecord] = ()
    ) -> None:
        """Attach libvirt's events to the running loop, load ``known`` records (the server's
        mirror, so instances whose domain vanished while the fleet was down show as ``lost``),
        connect ``hosts`` (default: one host ``local`` at ``config.default_uri``) and
        reconcile each."""
        LoopBridge.attach(asyncio.get_running_loop())
        for rec in known:
            self.index.setdefault(
                Entry(record=rec, state=InstanceState.UNKNOWN, reason="not yet reconciled")
            )
        specs = (
            list(hosts)
            if hosts is not None
            else [HostSpec(name="local", uri=self.config.default_uri)]
        )
        for spec in specs:
            await self.hosts.add_host(spec)

    async def close(self) -> None:
        """Stop background work and disconnect. Instances keep running."""
        ctx = self.context
        if ctx.closed:
            return
        ctx.closed = True
        self.pools.stop()
        await ctx.cancel_tasks()
        await self.hosts.close()
        await asyncio.sleep(0)  # let deferred libvirt handle removals run on this loop
        ctx.executor.shutdown(wait=True, cancel_futures=True)

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def accel(self, host: str) -> AccelReport | None:
        """Which accelerator guests on ``host`` use and why (KVM probe result)."""
        return self.hosts.host(host).accel

    # ------------------------------------------------------------------ what spans parts

    async def capture_state(
        self, instance_id: str, state_id: str, *, keep_running: bool = False
    ) -> SavedState:
        """Save a running instance's memory and disk as a reusable state (see `states`).

        The source is left shut off, unless ``keep_running``: then it is restored from the
        state it was just saved to (its own disk and identity), so it carries on after a pause
        of about a restore's time — a memory snapshot that clones can be made from."""
        self.states.check_new(state_id)
        record = self.index.entry(instance_id).record
        refuse_pool_member(record)
        host = self.hosts.host(record.host)
        return await self.states.capture(host, instance_id, state_id, keep_running=keep_running)

    async def delete_state(self, state_id: str) -> None:
        """Delete a saved state. Its memory image goes at once (nothing can be restored from it
        any more); its frozen disk stays while instances restored from it (or frozen disks of
        states captured from them) are backed by it, and is removed with the last of them.
        Refused while a warm pool still keeps clones of it (drain the pool first)."""
        st = self.states.get(state_id)
        if st is None:
            return
        users = self.pools.users_of(state_id)
        if users:
            raise Conflict(f"state {state_id} backs warm pool(s) {users}; drain them first")
        await self.states.delete(self.hosts.host(st.host), st)

    # ------------------------------------------------------------------ reconciliation

    async def reconcile(self, host: str | None = None) -> list[ReconcileReport]:
        """Make the index agree with the hosts (also automatic on open, add_host and every
        reconnect); unreachable hosts are skipped."""
        names = [host] if host else list(self.hosts)
        reports = []
        for name in names:
            h = self.hosts.host(name)
            if not h.reachable:
                continue
            reports.append(await self.reconciler.reconcile_host(h))
        return reports
