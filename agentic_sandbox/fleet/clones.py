"""Fast create: saved memory states and clones restored from them; clones from snapshots.

``capture_state`` saves a running instance's memory (``virDomainSave``) and copies its overlay
next to it, frozen: ``states/<state>.save`` + ``states/<state>.qcow2``. The source instance is
left shut off (start it again cold if you still want it).

``clone_from_state`` gives each new instance a fresh qcow2 overlay whose backing file is the
frozen disk, rewrites the XML inside the save image (libvirt refuses a restore that changes the
UUID through its ``dxml`` argument) with the new name, UUID, overlay, seed, serial log, forward
ports and record, defines that XML and restores the memory into it. Restores from one state are
serialised (the header is shared). The restored guest still has the golden guest's identity
(machine-id, host keys, hostname, clock); the layer above hands it a new one through the seed
drive (``set_seed``/``CloneSpec.seed``), see docs/fleet.md.

``clone_from_snapshot`` copies a snapshot's disk state into a new overlay (``qemu-img convert
-l``, on hosts whose files are local) and boots it cold; memory-fast clones go through saved
states.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid as uuidlib

import libvirt

from . import save_images
from .connection import HostConnection
from .core import Entry, FleetBase
from .disks import HostStorage
from .domain_xml import CloneIdentity, NetConfig, domain_facts, parse_record, rewrite_for_clone
from .errors import Conflict, FleetError, InvalidRequest, NotFound
from .lifecycle import Undo, domain_name_for
from .models import (
    CloneSpec,
    FleetEventKind,
    Instance,
    InstanceRecord,
    InstanceState,
    SavedState,
    utcnow,
    validate_name,
)


def read_save_header(storage: HostStorage, path: str) -> save_images.SaveHeader:
    first = storage.read_range(path, 0, save_images.QEMU_HEAD_LEN)
    total = save_images.prefix_length(first)
    return save_images.parse(storage.read_range(path, 0, total))


def write_save_header(
    storage: HostStorage, path: str, header: save_images.SaveHeader, xml: str
) -> None:
    data = save_images.rebuild(header, xml)
    if header.kind == "test":
        storage.write_whole(path, data)
    else:
        storage.write_at(path, 0, data)


def state_from_xml(state_id: str, host: str, save_path: str, xml: str) -> SavedState:
    facts = domain_facts(xml)
    rec = parse_record(xml)
    return SavedState(
        state_id=state_id,
        host=host,
        save_path=save_path,
        disk_path=facts.overlay or "",
        image=rec.image if rec else "",
        loadout=rec.loadout if rec else None,
        vcpus=facts.vcpus,
        memory_mib=facts.memory_mib,
        created_at=rec.created_at if rec else utcnow(),
    )


class CloneOps(FleetBase):
    # ------------------------------------------------------------------ saved states

    async def capture_state(
        self, instance_id: str, state_id: str, *, keep_running: bool = False
    ) -> SavedState:
        """Save a running instance's memory and disk as a reusable state (see module doc).

        The source is left shut off, unless ``keep_running``: then it is restored from the
        state it was just saved to (its own disk and identity), so it carries on after a pause
        of about a restore's time — a memory snapshot that clones can be made from."""
        validate_name(state_id)
        if state_id in self.saved_states:
            raise Conflict(f"saved state {state_id!r} already exists")
        e = self.entry(instance_id)
        async with e.lock, self.state_lock(state_id):
            h = self.host(e.record.host)
            _, storage = h.require()
            dom = await self.lookup_domain(e)
            if not await h.run(dom.isActive):
                raise InvalidRequest(f"instance {instance_id} must be running to capture it")
            save_path = storage.path("states", f"{state_id}.save")
            disk_path = storage.path("states", f"{state_id}.qcow2")
            undo = Undo()
            try:
                self.fault("save")
                undo.push("save", self._rm(h, save_path))
                await h.run(dom.save, save_path)
                self.set_state(e, InstanceState.SHUTOFF, f"memory saved as state {state_id}")
                self.fault("freeze")
                undo.push("disk", self._rm(h, disk_path))
                disk_path = await h.run(
                    storage.copy, e.record.overlay, "states", f"{state_id}.qcow2"
                )
                header = await h.run(read_save_header, storage, save_path)
                record = e.record.model_copy(
                    update={
                        "instance_id": instance_id,
                        "origin": f"state:{state_id}",
                        "created_at": utcnow(),
                        "overlay": disk_path,
                        "pool": None,
                        "crashes": [],
                    }
                )
                ident = CloneIdentity(
                    name=e.record.domain,
                    uuid=domain_facts(header.xml).uuid,
                    overlay=disk_path,
                    serial_log=e.record.serial_log,
                    seed=None,
                    net=NetConfig(
                        e.record.egress,
                        e.record.agent_port,
                        e.record.ssh_port,
                        self.config.control_address,
                    ),
                    record=record,
                )
                await h.run(
                    write_save_header,
                    storage,
                    save_path,
                    header,
                    rewrite_for_clone(header.xml, ident),
                )
                state = state_from_xml(
                    state_id, h.name, save_path, rewrite_for_clone(header.xml, ident)
                )
                if keep_running:
                    # The header now names the frozen disk; restore the source with its own
                    # XML (same UUID, its own overlay, unchanged since the save).
                    self.fault("resuming")
                    own_xml = await h.run(
                        dom.XMLDesc,
                        libvirt.VIR_DOMAIN_XML_SECURE | libvirt.VIR_DOMAIN_XML_INACTIVE,
                    )
                    conn, _ = h.require()
                    # libvirt's test driver cannot take replacement XML; its domains are
                    # not real, so restoring the header's XML there is equivalent.
                    dxml = None if h.domain_type == "test" else own_xml
                    await h.run(conn.restoreFlags, save_path, dxml, 0)
                    self.set_state(e, InstanceState.RUNNING, f"resumed after capturing {state_id}")
            except BaseException:
                await asyncio.shield(undo.run())
                raise
        self.saved_states[state_id] = state
        return state

    def _rm(self, h: HostConnection, path: str):  # type: ignore[no-untyped-def]
        async def undo() -> None:
            if h.storage is not None:
                await h.run(h.storage.delete, path)

        return undo

    async def list_states(self) -> list[SavedState]:
        return sorted(self.saved_states.values(), key=lambda s: s.state_id)

    async def delete_state(self, state_id: str) -> None:
        """Delete a saved state. Its memory image goes at once (nothing can be restored from it
        any more); its frozen disk stays while instances restored from it (or frozen disks of
        states captured from them) are backed by it, and is removed with the last of them.
        Refused while a warm pool still keeps clones of it (drain the pool first)."""
        st = self.saved_states.get(state_id)
        if st is None:
            return
        pools = getattr(self, "pools", {})
        users = [k for k, slot in pools.items() if slot.state_id == state_id and slot.size > 0]
        if users:
            raise Conflict(f"state {state_id} backs warm pool(s) {users}; drain them first")
        h = self.host(st.host)
        async with self.state_lock(state_id):
            _, storage = h.require()
            await h.run(storage.delete, st.save_path)
            self.saved_states.pop(state_id, None)
        await self.collect_frozen_disks(h)

    async def clone_from_state(
        self,
        state_id: str,
        spec: CloneSpec,
        *,
        paused: bool = False,
        pool: str | None = None,
        domain: str | None = None,
    ) -> Instance:
        """A new instance restored from a saved state (running, or ``paused``)."""
        st = self.saved_states.get(state_id)
        if st is None:
            raise NotFound(f"no saved state {state_id!r}")
        existing = self._reserve(  # type: ignore[attr-defined]
            spec.instance_id, lambda r: r.origin == f"state:{state_id}" and r.owner == spec.owner
        )
        if existing is not None:
            return self.view(existing)
        h = self.host(st.host)
        name = domain or domain_name_for(spec.instance_id)
        record = InstanceRecord(
            instance_id=spec.instance_id,
            domain=name,
            host=h.name,
            owner=spec.owner,
            incarnation=spec.incarnation,
            image=st.image,
            loadout=spec.loadout or st.loadout,
            egress=spec.egress,
            agent_port=spec.agent_port,
            vcpus=st.vcpus,
            memory_mib=st.memory_mib,
            origin=f"state:{state_id}",
            pool=pool,
            restart_on_crash=spec.restart_on_crash,
        )
        entry = Entry(record=record, state=InstanceState.DEFINED)
        self.entries[spec.instance_id] = entry
        undo = Undo()
        undo.push("index", self._forget(entry))  # type: ignore[attr-defined]
        stage = "disk"
        async with entry.lock:
            try:
                conn, storage = h.require()
                self.inflight.add((h.name, name))
                undo.push("inflight", self._uninflight(h.name, name))  # type: ignore[attr-defined]
                record.ssh_port = h.ports.allocate()
                undo.push("port", self._release_port(h, record.ssh_port))  # type: ignore[attr-defined]
                self.fault(stage)
                record.overlay = await h.run(
                    storage.create_overlay, "instances", f"{name}.qcow2", st.disk_path, None
                )
                undo.push("overlay", self._delete_file(h, record.overlay))  # type: ignore[attr-defined]
                stage = "seed"
                if spec.seed:
                    record.seed = await h.run(
                        storage.put_file, "instances", f"{name}.seed.iso", spec.seed
                    )
                    undo.push("seed", self._delete_file(h, record.seed))  # type: ignore[attr-defined]
                record.serial_log = storage.path("instances", f"{name}.serial.log")
                undo.push("serial", self._delete_file(h, record.serial_log))  # type: ignore[attr-defined]
                stage = "restoring"
                self.fault(stage)
                flags = (
                    libvirt.VIR_DOMAIN_SAVE_PAUSED if paused else libvirt.VIR_DOMAIN_SAVE_RUNNING
                )
                new_uuid = str(uuidlib.uuid4())
                ident = CloneIdentity(
                    name=name,
                    uuid=new_uuid,
                    overlay=record.overlay,
                    serial_log=record.serial_log,
                    seed=record.seed,
                    net=NetConfig(
                        spec.egress, spec.agent_port, record.ssh_port, self.config.control_address
                    ),
                    record=record,
                )
                async with self.state_lock(state_id):
                    header = await h.run(read_save_header, storage, st.save_path)
                    xml = rewrite_for_clone(header.xml, ident)
                    dom = await h.run(conn.defineXML, xml)
                    entry.uuid = new_uuid
                    undo.push("domain", self._undefine(h, name))  # type: ignore[attr-defined]
                    await h.run(write_save_header, storage, st.save_path, header, xml)
                    self.fault("restore")
                    if storage.virtual:
                        await h.run(conn.restoreFlags, st.save_path, None, 0)
                        if paused:
                            await h.run(dom.suspend)
                    else:
                        await h.run(conn.restoreFlags, st.save_path, None, flags)
                self.set_state(
                    entry,
                    InstanceState.PAUSED if paused else InstanceState.RUNNING,
                    f"restored from {state_id}",
                )
            except BaseException as e:
                entry.deleting = True
                await asyncio.shield(undo.run())
                if isinstance(e, FleetError):
                    e.stage = e.stage or stage
                    raise
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise FleetError(
                    f"clone {spec.instance_id} from {state_id} failed at {stage}: {e}", stage=stage
                ) from e
            self.inflight.discard((h.name, name))
        self.emit(
            FleetEventKind.INSTANCE_CREATED,
            host=h.name,
            instance_id=spec.instance_id,
            state=entry.state,
            detail=f"restored from state {state_id}",
        )
        return self.view(entry)

    # ------------------------------------------------------------------ from a snapshot

    async def clone_from_snapshot(
        self, source_id: str, snapshot: str, spec: CloneSpec, *, start: bool = True
    ) -> Instance:
        """A new instance whose disk is ``snapshot``'s disk state of ``source_id`` (cold
        boot). Needs a host whose files are local (the copy uses ``qemu-img``)."""
        validate_name(snapshot)
        src = self.entry(source_id)
        h = self.host(src.record.host)
        conn, storage = h.require()
        if not h.files_local or storage.virtual:
            raise InvalidRequest(
                "clone_from_snapshot needs a host with local files; use "
                "capture_state/clone_from_state for remote hosts"
            )
        if self.entries.get(spec.instance_id) is not None:
            raise Conflict(f"instance {spec.instance_id!r} already exists")
        dom = await self.lookup_domain(src)
        src_xml = await h.run(dom.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE)
        try:
            await h.run(dom.snapshotLookupByName, snapshot, 0)
        except NotFound as err:
            raise NotFound(f"instance {source_id} has no snapshot {snapshot!r}") from err
        base = await h.run(storage.image_path, src.record.image)
        name = domain_name_for(spec.instance_id)
        record = src.record.model_copy(
            update={
                "instance_id": spec.instance_id,
                "domain": name,
                "owner": spec.owner,
                "incarnation": spec.incarnation,
                "loadout": spec.loadout or src.record.loadout,
                "egress": spec.egress,
                "agent_port": spec.agent_port,
                "origin": f"snapshot:{source_id}/{snapshot}",
                "created_at": utcnow(),
                "crashes": [],
                "pool": None,
                "seed": None,
                "restart_on_crash": spec.restart_on_crash,
            }
        )
        entry = Entry(record=record, state=InstanceState.DEFINED)
        self.entries[spec.instance_id] = entry
        undo = Undo()
        undo.push("index", self._forget(entry))  # type: ignore[attr-defined]
        stage = "disk"
        async with entry.lock:
            try:
                self.inflight.add((h.name, name))
                undo.push("inflight", self._uninflight(h.name, name))  # type: ignore[attr-defined]
                record.ssh_port = h.ports.allocate()
                undo.push("port", self._release_port(h, record.ssh_port))  # type: ignore[attr-defined]
                overlay = storage.path("instances", f"{name}.qcow2")
                undo.push("overlay", self._delete_file(h, overlay))  # type: ignore[attr-defined]
                self.fault(stage)
                await h.run(_convert_snapshot, src.record.overlay, snapshot, base, overlay)
                record.overlay = overlay
                if spec.seed:
                    stage = "seed"
                    record.seed = await h.run(
                        storage.put_file, "instances", f"{name}.seed.iso", spec.seed
                    )
                    undo.push("seed", self._delete_file(h, record.seed))  # type: ignore[attr-defined]
                record.serial_log = storage.path("instances", f"{name}.serial.log")
                undo.push("serial", self._delete_file(h, record.serial_log))  # type: ignore[attr-defined]
                stage = "defining"
                self.fault(stage)
                ident = CloneIdentity(
                    name=name,
                    uuid=str(uuidlib.uuid4()),
                    overlay=overlay,
                    serial_log=record.serial_log,
                    seed=record.seed,
                    net=NetConfig(
                        spec.egress, spec.agent_port, record.ssh_port, self.config.control_address
                    ),
                    record=record,
                )
                new = await h.run(conn.defineXML, rewrite_for_clone(src_xml, ident))
                entry.uuid = ident.uuid
                undo.push("domain", self._undefine(h, name))  # type: ignore[attr-defined]
                if start:
                    stage = "booting"
                    self.fault(stage)
                    await h.run(new.create)
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
                    f"clone of {source_id}@{snapshot} failed at {stage}: {e}", stage=stage
                ) from e
            self.inflight.discard((h.name, name))
        self.emit(
            FleetEventKind.INSTANCE_CREATED,
            host=h.name,
            instance_id=spec.instance_id,
            state=entry.state,
            detail=f"cloned from {source_id}@{snapshot}",
        )
        return self.view(entry)


def _convert_snapshot(src: str, snapshot: str, base: str, dest: str) -> None:
    """Blocking: ``dest`` = overlay on ``base`` holding ``src``'s disk at ``snapshot``."""
    argv = [
        "qemu-img",
        "convert",
        "-U",
        "-q",
        "-f",
        "qcow2",
        "-O",
        "qcow2",
        "-l",
        f"snapshot.name={snapshot}",
        "-F",
        "qcow2",
        "-B",
        base,
        src,
        dest,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        if os.path.exists(dest):
            os.unlink(dest)
        raise FleetError(f"qemu-img convert failed: {proc.stderr.strip()}", stage="disk")
    os.chmod(dest, 0o600)
