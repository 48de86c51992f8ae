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
from .hosts import DriverFactory, HostRegistry
from .index import Entry, InstanceIndex
from .kvm_probe import AccelReport
from .libvirt import LibvirtHost, LoopBridge
from .lifecycle import Lifecycle
from .models import (
    CloneSpec,
    EgressPolicy,
    FleetConfig,
    HostInfo,
    HostSpec,
    Instance,
    InstanceRecord,
    InstanceSpec,
    InstanceState,
    ReconcileReport,
    SavedState,
    SnapshotInfo,
)
from .monitor import Monitor
from .reconcile import Reconciler
from .snapshots import Snapshots
from .states import SavedStates
from .warm_pool import PoolStatus, WarmPool


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
        make_driver: DriverFactory | None = None,
    ) -> None:
        ctx = self.context = FleetContext(
            config, on_event=on_event, fault_hook=fault_hook, on_call=on_call
        )
        self.config = ctx.config
        self.index = InstanceIndex(ctx)
        self.states = SavedStates(ctx, self.index)
        self.reconciler = Reconciler(ctx, self.index, self.states)
        self.monitor = Monitor(ctx, self.index, self.reconciler)
        self.hosts = HostRegistry(
            ctx,
            self.index,
            self.states,
            make_driver=make_driver or self._libvirt_host,
            reconcile=self.reconciler.reconcile_host,
        )
        self.lifecycle = Lifecycle(ctx, self.index, self.hosts, self.states)
        self.snapshots = Snapshots(ctx, self.index, self.hosts)
        self.clones = Clones(ctx, self.index, self.hosts, self.states)
        self.pools = WarmPool(ctx, self.index, self.hosts, self.states, self.clones, self.lifecycle)

    def _libvirt_host(self, spec: HostSpec) -> HostDriver:
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

    # ------------------------------------------------------------------ hosts

    async def add_host(self, spec: HostSpec) -> HostInfo:
        return await self.hosts.add_host(spec)

    async def remove_host(
        self, name: str, *, force: bool = False, forget_storage: bool = False
    ) -> None:
        await self.hosts.remove_host(name, force=force, forget_storage=forget_storage)

    async def list_hosts(self) -> list[HostInfo]:
        return await self.hosts.list_hosts()

    async def host_info(self, name: str) -> HostInfo:
        return await self.hosts.host_info(name)

    async def import_image(
        self, name: str, path: str, *, host: str | None = None, replace: bool = False
    ) -> dict[str, str]:
        return await self.hosts.import_image(name, path, host=host, replace=replace)

    def accel(self, host: str) -> AccelReport | None:
        """Which accelerator guests on ``host`` use and why (KVM probe result)."""
        return self.hosts.host(host).accel

    # ------------------------------------------------------------------ instances

    async def create(self, spec: InstanceSpec, *, start: bool = True) -> Instance:
        return await self.lifecycle.create(spec, start=start)

    async def get(self, instance_id: str) -> Instance:
        return await self.lifecycle.get(instance_id)

    async def list_instances(
        self, *, host: str | None = None, owner: str | None = None, include_pooled: bool = False
    ) -> list[Instance]:
        return await self.lifecycle.list_instances(
            host=host, owner=owner, include_pooled=include_pooled
        )

    async def start(self, instance_id: str) -> Instance:
        return await self.lifecycle.start(instance_id)

    async def shutdown(self, instance_id: str, *, grace_s: float | None = None) -> Instance:
        return await self.lifecycle.shutdown(instance_id, grace_s=grace_s)

    async def force_off(self, instance_id: str) -> Instance:
        return await self.lifecycle.force_off(instance_id)

    async def reboot(self, instance_id: str, *, hard: bool = False) -> Instance:
        return await self.lifecycle.reboot(instance_id, hard=hard)

    async def suspend(self, instance_id: str) -> Instance:
        return await self.lifecycle.suspend(instance_id)

    async def resume(self, instance_id: str) -> Instance:
        return await self.lifecycle.resume(instance_id)

    async def delete(self, instance_id: str) -> None:
        await self.lifecycle.delete(instance_id)

    async def set_seed(self, instance_id: str, seed: str | None) -> Instance:
        return await self.lifecycle.set_seed(instance_id, seed)

    async def read_serial_log(self, instance_id: str, offset: int = 0) -> bytes:
        return await self.lifecycle.read_serial_log(instance_id, offset)

    # ------------------------------------------------------------------ snapshots

    async def create_snapshot(
        self, instance_id: str, name: str, *, with_memory: bool | None = None, description: str = ""
    ) -> SnapshotInfo:
        return await self.snapshots.create_snapshot(
            instance_id, name, with_memory=with_memory, description=description
        )

    async def list_snapshots(self, instance_id: str) -> list[SnapshotInfo]:
        return await self.snapshots.list_snapshots(instance_id)

    async def revert_snapshot(
        self, instance_id: str, name: str, *, paused: bool = False
    ) -> Instance:
        return await self.snapshots.revert_snapshot(instance_id, name, paused=paused)

    async def delete_snapshot(self, instance_id: str, name: str) -> None:
        await self.snapshots.delete_snapshot(instance_id, name)

    # ------------------------------------------------------------------ saved states, clones

    async def capture_state(
        self, instance_id: str, state_id: str, *, keep_running: bool = False
    ) -> SavedState:
        """Save a running instance's memory and disk as a reusable state (see `states`).

        The source is left shut off, unless ``keep_running``: then it is restored from the
        state it was just saved to (its own disk and identity), so it carries on after a pause
        of about a restore's time — a memory snapshot that clones can be made from."""
        self.states.check_new(state_id)
        host = self.hosts.host(self.index.entry(instance_id).record.host)
        return await self.states.capture(host, instance_id, state_id, keep_running=keep_running)

    async def list_states(self) -> list[SavedState]:
        return await self.states.list_states()

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

    async def clone_from_state(
        self,
        state_id: str,
        spec: CloneSpec,
        *,
        paused: bool = False,
        pool: str | None = None,
        domain: str | None = None,
    ) -> Instance:
        return await self.clones.clone_from_state(
            state_id, spec, paused=paused, pool=pool, domain=domain
        )

    async def clone_from_snapshot(
        self, source_id: str, snapshot: str, spec: CloneSpec, *, start: bool = True
    ) -> Instance:
        return await self.clones.clone_from_snapshot(source_id, snapshot, spec, start=start)

    # ------------------------------------------------------------------ warm pool

    async def configure_pool(
        self,
        key: str,
        state_id: str,
        size: int,
        *,
        egress: EgressPolicy = EgressPolicy.ISOLATED,
        agent_port: int = 8120,
        wait: bool = False,
    ) -> PoolStatus:
        return await self.pools.configure_pool(
            key, state_id, size, egress=egress, agent_port=agent_port, wait=wait
        )

    async def pool_status(self) -> list[PoolStatus]:
        return await self.pools.pool_status()

    async def take_from_pool(self, key: str, spec: CloneSpec) -> Instance | None:
        return await self.pools.take_from_pool(key, spec)

    async def remove_pool(self, key: str) -> None:
        await self.pools.remove_pool(key)

    async def drain_pools(self) -> None:
        await self.pools.drain_pools()

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
