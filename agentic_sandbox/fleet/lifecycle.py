"""Instance lifecycle: create (define), start, shutdown, force-off, reboot, suspend/resume,
delete, seed hand-off, serial log; lifecycle events and crash handling.

Every operation is idempotent (asking for the state an instance is already in is a no-op; deleting
what is gone succeeds) and a multi-step create either completes or removes every piece it made
(domain, overlay, seed, serial log, port, index entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid as uuidlib
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import libvirt

from .connection import HostConnection
from .core import Entry, FleetBase
from .disks import HostStorage
from .domain_xml import (
    METADATA_NS,
    METADATA_PREFIX,
    DomainConfig,
    KernelPaths,
    NetConfig,
    build_domain_xml,
    record_metadata_xml,
)
from .errors import Conflict, FleetError, InvalidRequest, LibvirtFailure, NotFound
from .events import state_from_domain, state_from_event
from .models import (
    DOMAIN_PREFIX,
    CrashRecord,
    FleetEventKind,
    Instance,
    InstanceRecord,
    InstanceSpec,
    InstanceState,
    KernelBoot,
    utcnow,
)
from .placement import PlacementRequest, choose_host

log = logging.getLogger(__name__)
GiB = 1 << 30

_UNDEFINE_ALL = (
    libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
    | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
    | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
    | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
)
_UNDEFINE_BASIC = (
    libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
)


def domain_name_for(instance_id: str) -> str:
    return f"{DOMAIN_PREFIX}{instance_id}"


def remove_domain(dom: libvirt.virDomain) -> None:
    """Blocking: destroy (if running) and undefine with everything libvirt keeps for it."""
    with contextlib.suppress(libvirt.libvirtError):
        if dom.isActive():
            dom.destroy()
    try:
        dom.undefineFlags(_UNDEFINE_ALL)
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return
        try:
            dom.undefineFlags(_UNDEFINE_BASIC)
        except libvirt.libvirtError as e2:
            if e2.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise


def remove_files(storage: HostStorage, record: InstanceRecord) -> list[str]:
    """Blocking: the instance's overlay, seeds and serial logs; returns what was removed."""
    removed: list[str] = []
    paths: list[str] = [record.overlay, record.seed or "", record.serial_log]
    prefix = record.domain + "."
    paths += [
        storage.path("instances", n)
        for n in storage.list_names("instances")
        if n.startswith(prefix)
    ]
    for p in dict.fromkeys(paths):
        if p and storage.delete(p):
            removed.append(p)
    return removed


def save_record(dom: libvirt.virDomain, record: InstanceRecord) -> None:
    """Blocking: write the record into the domain's metadata (live and persistent)."""
    flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
    if dom.isActive():
        flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
    dom.setMetadata(
        libvirt.VIR_DOMAIN_METADATA_ELEMENT,
        record_metadata_xml(record),
        METADATA_PREFIX,
        METADATA_NS,
        flags,
    )


@dataclass
class Undo:
    """Steps to take back, newest first, if a multi-step operation fails."""

    steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = field(default_factory=list)

    def push(self, what: str, fn: Callable[[], Awaitable[Any]]) -> None:
        self.steps.append((what, fn))

    async def run(self) -> None:
        for what, fn in reversed(self.steps):
            try:
                await fn()
            except Exception:
                log.exception("clean-up step %r failed", what)
        self.steps.clear()


class LifecycleOps(FleetBase):
    # ------------------------------------------------------------------ queries

    async def get(self, instance_id: str) -> Instance:
        return self.view(self.entry(instance_id))

    async def list_instances(
        self, *, host: str | None = None, owner: str | None = None, include_pooled: bool = False
    ) -> list[Instance]:
        out = []
        for e in list(self.entries.values()):
            if host is not None and e.record.host != host:
                continue
            if owner is not None and e.record.owner != owner:
                continue
            if e.record.pool and not include_pooled:
                continue
            out.append(self.view(e))
        return sorted(out, key=lambda i: i.instance_id)

    # ------------------------------------------------------------------ create

    def _reserve(self, instance_id: str, same: Callable[[InstanceRecord], bool]) -> Entry | None:
        """Claim ``instance_id`` in the index; returns the existing entry for an idempotent
        repeat, raises Conflict when the id is taken by something else."""
        existing = self.entries.get(instance_id)
        if existing is not None:
            if not existing.deleting and same(existing.record):
                return existing
            raise Conflict(f"instance {instance_id!r} already exists")
        return None

    async def place(self, req: PlacementRequest) -> HostConnection:
        loads = await self.host_loads()  # type: ignore[attr-defined]
        return self.host(choose_host(loads, req))

    async def create(self, spec: InstanceSpec, *, start: bool = True) -> Instance:
        """Define (and by default start) a new instance. Repeating the same request returns
        the existing instance; on failure nothing of it is left behind."""
        existing = self._reserve(
            spec.instance_id, lambda r: r.image == spec.image and r.owner == spec.owner
        )
        if existing is not None:
            async with existing.lock:
                if start and existing.state in (InstanceState.DEFINED, InstanceState.SHUTOFF):
                    await self._start_locked(existing)
            return self.view(existing)

        name = domain_name_for(spec.instance_id)
        record = InstanceRecord(
            instance_id=spec.instance_id,
            domain=name,
            host="",
            owner=spec.owner,
            incarnation=spec.incarnation,
            image=spec.image,
            loadout=spec.loadout,
            egress=spec.egress,
            agent_port=spec.agent_port,
            vcpus=spec.resources.vcpus,
            memory_mib=spec.resources.memory_mib,
            anti_affinity=spec.anti_affinity,
            restart_on_crash=spec.restart_on_crash,
        )
        entry = Entry(record=record, state=InstanceState.DEFINED)
        self.entries[spec.instance_id] = entry
        undo = Undo()
        undo.push("index", self._forget(entry))
        stage = "placing"
        async with entry.lock:
            try:
                self.fault(stage)
                async with self.placement_lock:
                    h = await self.place(
                        PlacementRequest(
                            vcpus=spec.resources.vcpus,
                            memory_mib=spec.resources.memory_mib,
                            labels=spec.host_labels,
                            anti_affinity=spec.anti_affinity,
                            pinned=spec.host,
                        )
                    )
                    record.host = h.name
                conn, storage = h.require()
                self.inflight.add((h.name, name))
                undo.push("inflight", self._uninflight(h.name, name))

                stage = "ports"
                self.fault(stage)
                record.ssh_port = h.ports.allocate()
                undo.push("port", self._release_port(h, record.ssh_port))

                stage = "disk"
                if await h.run(_domain_exists, conn, name):
                    raise Conflict(f"a domain named {name} already exists on {h.name}")
                base = await h.run(storage.image_path, spec.image)
                boot: KernelPaths | Any = spec.boot
                if isinstance(spec.boot, KernelBoot):
                    kb = spec.boot
                    kernel = await h.run(storage.image_path, kb.kernel)
                    initrd = await h.run(storage.image_path, kb.initrd) if kb.initrd else None
                    boot = KernelPaths(kernel, initrd, kb.cmdline)
                cap = spec.resources.disk_gib * GiB if spec.resources.disk_gib else None
                overlay_name = f"{name}.qcow2"
                stale = storage.path("instances", overlay_name)
                await h.run(storage.delete, stale)  # a leftover with no domain is an orphan
                self.fault(stage)
                record.overlay = await h.run(
                    storage.create_overlay, "instances", overlay_name, base, cap
                )
                undo.push("overlay", self._delete_file(h, record.overlay))

                stage = "seed"
                self.fault(stage)
                if spec.seed:
                    record.seed = await h.run(
                        storage.put_file, "instances", f"{name}.seed.iso", spec.seed
                    )
                    undo.push("seed", self._delete_file(h, record.seed))
                record.serial_log = storage.path("instances", f"{name}.serial.log")
                undo.push("serial", self._delete_file(h, record.serial_log))

                stage = "defining"
                self.fault(stage)
                res = spec.resources
                cfg = DomainConfig(
                    name=name,
                    uuid=str(uuidlib.uuid4()),
                    domain_type=h.domain_type,
                    vcpus=res.vcpus,
                    memory_mib=res.memory_mib,
                    overlay=record.overlay,
                    serial_log=record.serial_log,
                    seed=record.seed,
                    record=record,
                    boot=boot,
                    net=NetConfig(
                        spec.egress, spec.agent_port, record.ssh_port, self.config.control_address
                    ),
                    machine=self.config.machine,
                    nic_pci_slot=self.config.nic_pci_slot,
                    cpu_shares=res.cpu_shares,
                    cpu_quota_pct=res.cpu_quota_pct,
                    iotune=res.iotune,
                    tb_cache_mib=res.tb_cache_mib,
                    title=f"agentic-sandbox instance {spec.instance_id}",
                )
                xml = build_domain_xml(cfg)
                dom = await h.run(conn.defineXML, xml)
                entry.uuid = await h.run(dom.UUIDString)
                undo.push("domain", self._undefine(h, name))
                self.fault("defined")

                if start:
                    stage = "booting"
                    self.fault(stage)
                    await h.run(dom.create)
                    self.set_state(entry, InstanceState.RUNNING, "started")
            except BaseException as e:
                entry.deleting = True
                await asyncio.shield(undo.run())
                if isinstance(e, FleetError):
                    e.stage = e.stage or stage
                    raise
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise FleetError(
                    f"create {spec.instance_id} failed at {stage}: {e}", stage=stage
                ) from e
            self.inflight.discard((record.host, name))
        self.emit(
            FleetEventKind.INSTANCE_CREATED,
            host=record.host,
            instance_id=spec.instance_id,
            state=entry.state,
        )
        return self.view(entry)

    # undo step factories --------------------------------------------------------------

    def _forget(self, entry: Entry) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            if self.entries.get(entry.record.instance_id) is entry:
                del self.entries[entry.record.instance_id]

        return undo

    def _uninflight(self, host: str, name: str) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            self.inflight.discard((host, name))

        return undo

    def _release_port(self, h: HostConnection, port: int | None) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            h.ports.release(port)

        return undo

    def _delete_file(self, h: HostConnection, path: str | None) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            if path and h.storage is not None:
                await h.run(h.storage.delete, path)

        return undo

    def _undefine(self, h: HostConnection, name: str) -> Callable[[], Awaitable[None]]:
        async def undo() -> None:
            conn, _ = h.require()

            def go() -> None:
                try:
                    dom = conn.lookupByName(name)
                except libvirt.libvirtError as e:
                    if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                        return
                    raise
                remove_domain(dom)

            await h.run(go)

        return undo

    # ------------------------------------------------------------------ state changes

    async def _start_locked(self, e: Entry) -> None:
        dom = await self.lookup_domain(e)
        h = self.host(e.record.host)
        if await h.run(dom.isActive):
            st, _ = await h.run(dom.state)
            if st == libvirt.VIR_DOMAIN_PAUSED:
                await h.run(dom.resume)
                self.set_state(e, InstanceState.RUNNING, "resumed")
            return
        await h.run(dom.create)
        self.set_state(e, InstanceState.RUNNING, "started")

    async def start(self, instance_id: str) -> Instance:
        e = self.entry(instance_id)
        async with e.lock:
            self._check_live(e)
            await self._start_locked(e)
        return self.view(e)

    async def shutdown(self, instance_id: str, *, grace_s: float | None = None) -> Instance:
        """Ask the guest to power off; after ``grace_s`` seconds, force it off."""
        e = self.entry(instance_id)
        timeout = self.config.shutdown_timeout_s if grace_s is None else grace_s
        async with e.lock:
            self._check_live(e)
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)
            if not await h.run(dom.isActive):
                return self.view(e)
            with contextlib.suppress(FleetError):
                await h.run(dom.shutdown)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while loop.time() < deadline:
                if not await h.run(dom.isActive):
                    break
                await asyncio.sleep(0.2)
            else:
                with contextlib.suppress(FleetError):
                    await h.run(dom.destroy)
                self.set_state(
                    e, InstanceState.SHUTOFF, f"forced off after {timeout:g}s graceful timeout"
                )
                return self.view(e)
            self.set_state(e, InstanceState.SHUTOFF, "guest shut down")
        return self.view(e)

    async def force_off(self, instance_id: str) -> Instance:
        e = self.entry(instance_id)
        async with e.lock:
            self._check_live(e)
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)
            if await h.run(dom.isActive):
                await h.run(dom.destroy)
            self.set_state(e, InstanceState.SHUTOFF, "powered off")
        return self.view(e)

    async def reboot(self, instance_id: str, *, hard: bool = False) -> Instance:
        """ACPI reboot request (the guest decides), or ``hard``: an immediate reset."""
        e = self.entry(instance_id)
        async with e.lock:
            self._check_live(e)
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)
            if not await h.run(dom.isActive):
                raise InvalidRequest(f"instance {instance_id} is not running")
            if hard:
                await h.run(dom.reset, 0)
            else:
                await h.run(dom.reboot, 0)
        return self.view(e)

    async def suspend(self, instance_id: str) -> Instance:
        e = self.entry(instance_id)
        async with e.lock:
            self._check_live(e)
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)
            st, _ = await h.run(dom.state)
            if st == libvirt.VIR_DOMAIN_PAUSED:
                return self.view(e)
            if not await h.run(dom.isActive):
                raise InvalidRequest(f"instance {instance_id} is not running")
            await h.run(dom.suspend)
            self.set_state(e, InstanceState.PAUSED, "suspended")
        return self.view(e)

    async def resume(self, instance_id: str) -> Instance:
        e = self.entry(instance_id)
        async with e.lock:
            self._check_live(e)
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)
            st, _ = await h.run(dom.state)
            if st == libvirt.VIR_DOMAIN_RUNNING:
                return self.view(e)
            if st != libvirt.VIR_DOMAIN_PAUSED:
                raise InvalidRequest(f"instance {instance_id} is not paused")
            await h.run(dom.resume)
            self.set_state(e, InstanceState.RUNNING, "resumed")
        return self.view(e)

    def _check_live(self, e: Entry) -> None:
        if e.deleting:
            raise NotFound(f"instance {e.record.instance_id} is being deleted")
        if e.state is InstanceState.LOST:
            raise InvalidRequest(f"instance {e.record.instance_id} is lost (its domain is gone)")

    # ------------------------------------------------------------------ delete

    async def delete(self, instance_id: str) -> None:
        """Remove the domain (with snapshots, managed save), overlay, seeds, serial logs and
        port. Deleting an instance that does not exist succeeds."""
        e = self.entries.get(instance_id)
        if e is None:
            return
        async with e.lock:
            if self.entries.get(instance_id) is not e:
                return
            e.deleting = True
            h = self.host(e.record.host)
            conn, storage = h.require()
            self.inflight.add((h.name, e.record.domain))
            try:

                def go() -> None:
                    dom = None
                    for find in (
                        lambda: conn.lookupByUUIDString(e.uuid) if e.uuid else None,
                        lambda: conn.lookupByName(e.record.domain),
                    ):
                        try:
                            dom = find()
                        except libvirt.libvirtError as err:
                            if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                                raise
                        if dom is not None:
                            break
                    if dom is not None:
                        remove_domain(dom)
                    remove_files(storage, e.record)

                self.fault("delete")
                await h.run(go)
            except BaseException:
                e.deleting = False
                raise
            finally:
                self.inflight.discard((h.name, e.record.domain))
            h.ports.release(e.record.ssh_port)
            del self.entries[instance_id]
        # a deleted state's frozen disk goes with the last instance backed by it
        await self.collect_frozen_disks(h)
        self.emit(
            FleetEventKind.INSTANCE_DELETED,
            host=e.record.host,
            instance_id=instance_id,
            detail="deleted",
        )

    # ------------------------------------------------------------------ identity hand-off

    async def set_seed(self, instance_id: str, seed: str | None) -> Instance:
        """Put a new seed ISO in the instance's seed drive (a media change the running guest
        sees), or eject it (``None``). This is how a clone or a pooled guest is handed its new
        identity: the layer above writes a seed with the new hostname, instance id, keys and
        enrollment token, and the in-guest agent re-reads it on the media change."""
        e = self.entry(instance_id)
        async with e.lock:
            self._check_live(e)
            await self._set_seed_locked(e, seed)
        return self.view(e)

    async def _set_seed_locked(self, e: Entry, seed: str | None) -> None:
        h = self.host(e.record.host)
        _, storage = h.require()
        dom = await self.lookup_domain(e)
        old = e.record.seed
        new_path = None
        if seed is not None:
            new_path = await h.run(
                storage.put_file,
                "instances",
                f"{e.record.domain}.seed-{secrets.token_hex(4)}.iso",
                seed,
            )
        try:
            xml = await h.run(dom.XMLDesc, 0)
            cd = _cdrom_xml(xml, new_path)
            flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
            if await h.run(dom.isActive):
                # FORCE: eject even when the guest has the tray locked (a reader of the
                # device holds it); the guest sees a media change either way.
                flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE | libvirt.VIR_DOMAIN_DEVICE_MODIFY_FORCE
            await h.run(dom.updateDeviceFlags, cd, flags)
            record = e.record.model_copy(update={"seed": new_path})
            await h.run(save_record, dom, record)
        except BaseException:
            if new_path:
                await h.run(storage.delete, new_path)
            raise
        e.record = record
        if old and old != new_path:
            await h.run(storage.delete, old)

    # ------------------------------------------------------------------ serial log

    async def read_serial_log(self, instance_id: str, offset: int = 0) -> bytes:
        """The serial console log from ``offset`` (works for remote hosts too)."""
        e = self.entry(instance_id)
        h = self.host(e.record.host)
        _, storage = h.require()
        try:
            return await h.run(storage.read_range, e.record.serial_log, offset, None)
        except NotFound:
            return b""

    # ------------------------------------------------------------------ events

    def on_lifecycle(
        self, h: HostConnection, name: str, uuid: str, event: int, detail: int
    ) -> None:
        """libvirt lifecycle event (on the loop thread)."""
        e = self.entry_by_domain(h.name, name, uuid)
        if e is None:
            if (
                name.startswith(DOMAIN_PREFIX)
                and event == libvirt.VIR_DOMAIN_EVENT_DEFINED
                and (h.name, name) not in self.inflight
            ):
                self.spawn(self._adopt_later(h))
            return
        if e.deleting:
            return
        if event == libvirt.VIR_DOMAIN_EVENT_UNDEFINED:
            if (h.name, e.record.domain) not in self.inflight:
                self.set_state(e, InstanceState.LOST, "domain undefined outside the fleet")
            return
        state, crashed, why = state_from_event(event, detail)
        if state is None:
            return
        self.set_state(e, state, why)
        if crashed:
            self.spawn(self._handle_crash(e, why))

    async def _adopt_later(self, h: HostConnection) -> None:
        await asyncio.sleep(0.05)
        await self.reconcile_host(h)

    async def _handle_crash(self, e: Entry, why: str) -> None:
        now = utcnow()
        keep = self.config.crash_loop_threshold * 2
        record = e.record.model_copy(
            update={"crashes": [*e.record.crashes, CrashRecord(at=now, reason=why)][-keep:]}
        )
        e.record = record
        self.emit(
            FleetEventKind.INSTANCE_CRASHED,
            host=record.host,
            instance_id=record.instance_id,
            state=InstanceState.CRASHED,
            detail=why,
        )
        h = self.host(record.host)
        loop_detected = self.crash_detector.is_loop(record.crashes, now)
        with contextlib.suppress(FleetError):
            dom = await self.lookup_domain(e)
            await h.run(save_record, dom, record)
        if loop_detected:
            n = len(self.crash_detector.recent(record.crashes, now))
            e.reason = f"crash loop: {n} crashes in {self.config.crash_loop_window_s:g}s"
            self.emit(
                FleetEventKind.INSTANCE_CRASH_LOOP,
                host=record.host,
                instance_id=record.instance_id,
                state=InstanceState.CRASHED,
                detail=e.reason + "; automatic restarts stopped",
            )
            return
        if not record.restart_on_crash:
            return
        await asyncio.sleep(self.config.restart_delay_s)
        async with e.lock:
            if e.deleting or e.state is not InstanceState.CRASHED:
                return
            try:
                await self._start_locked(e)
            except FleetError as err:
                log.warning("restart of %s after crash failed: %s", record.instance_id, err)

    def on_disconnect(self, h: HostConnection, why: str) -> None:
        self.emit(FleetEventKind.HOST_UNREACHABLE, host=h.name, detail=why)
        for e in list(self.entries.values()):
            if e.record.host == h.name and e.state is not InstanceState.LOST:
                self.set_state(e, InstanceState.UNKNOWN, f"host unreachable: {why}")

    async def on_reconnect(self, h: HostConnection) -> None:
        self.emit(
            FleetEventKind.HOST_RECONNECTED, host=h.name, detail=f"connection #{h.connect_count}"
        )
        await self.reconcile_host(h)

    def observe(self, e: Entry, state: int, reason: int) -> InstanceState:
        new = state_from_domain(state, reason)
        self.set_state(e, new, "observed")
        return new


def _domain_exists(conn: libvirt.virConnect, name: str) -> bool:
    try:
        conn.lookupByName(name)
        return True
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return False
        raise


def _cdrom_xml(domain_xml: str, path: str | None) -> str:
    root = ET.fromstring(domain_xml)
    for disk in root.iterfind("devices/disk"):
        if disk.get("device") != "cdrom":
            continue
        src = disk.find("source")
        if src is not None:
            disk.remove(src)
        if path:
            disk.insert(1, ET.Element("source", {"file": path}))
        return ET.tostring(disk, encoding="unicode")
    raise LibvirtFailure("instance has no seed drive")
