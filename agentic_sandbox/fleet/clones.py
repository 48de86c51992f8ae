"""Fast create: new instances restored from a saved state; clones from snapshots.

``clone_from_state`` gives each new instance a fresh qcow2 overlay whose backing file is the
state's frozen disk, gives the definition inside the save image a new identity (libvirt refuses
a restore that changes the UUID through its ``dxml`` argument) — name, UUID, overlay, seed,
serial log, forward ports and record — defines it and restores the memory into it. Restores
from one state are serialised (the header is shared). The restored guest still has the golden
guest's identity (machine-id, host keys, hostname, clock); the layer above hands it a new one
through the seed drive (``set_seed``/``CloneSpec.seed``), see docs/fleet.md.

``clone_from_snapshot`` copies a snapshot's disk state into a new overlay (``qemu-img convert
-l``, on hosts whose files are local) and boots it cold; memory-fast clones go through saved
states.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass

from .build import NewInstance
from .context import FleetContext
from .domain_config import CloneIdentity, control_address, domain_name_for, net_config
from .driver import require_reachable
from .errors import Conflict, InvalidRequest, NotFound
from .hosts import HostRegistry
from .index import Entry, InstanceIndex
from .lifecycle import lookup
from .models import (
    CloneSpec,
    Instance,
    InstanceRecord,
    InstanceState,
    utcnow,
    validate_name,
)
from .states import SavedStates


@dataclass(eq=False)
class Clones:
    ctx: FleetContext
    index: InstanceIndex
    hosts: HostRegistry
    states: SavedStates

    def _identity(
        self, new: NewInstance, spec: CloneSpec, overlay: str, uuid: str
    ) -> CloneIdentity:
        record = new.record
        return CloneIdentity(
            name=record.domain,
            uuid=uuid,
            overlay=overlay,
            serial_log=record.serial_log,
            seed=record.seed,
            net=net_config(
                spec.egress,
                spec.agent_port,
                record.ssh_port,
                control_address(new.host.spec, self.ctx.config),
            ),
            record=record,
        )

    # ------------------------------------------------------------------ from a saved state

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
        st = self.states.get(state_id)
        if st is None:
            raise NotFound(f"no saved state {state_id!r}")
        existing = self.index.reserve(
            spec.instance_id, lambda r: r.origin == f"state:{state_id}" and r.owner == spec.owner
        )
        if existing is not None:
            return self.index.view(existing)
        h = self.hosts.host(st.host)
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
        new = NewInstance(
            self.ctx,
            self.index,
            entry,
            f"clone {spec.instance_id} from {state_id}",
            stage="disk",
        )
        async with new:
            vol = h.volumes
            new.claim(h)
            new.allocate_port()
            new.step("disk")
            record.overlay = await vol.create_overlay(
                "instances", f"{name}.qcow2", st.disk_path, None
            )
            new.made_file("overlay", record.overlay)
            new.tx.stage = "seed"
            await new.seed_and_serial_log(spec.seed)
            new.step("restoring")
            ident = self._identity(new, spec, record.overlay, str(uuidlib.uuid4()))
            async with self.states.lock(state_id):
                image = await vol.read_saved(st.save_path)
                definition = h.reidentify(image.definition, ident)
                dom = await new.define(definition, uuid=ident.uuid)
                await vol.write_saved(st.save_path, image, definition)
                self.ctx.fault("restore")
                await dom.restore(st.save_path, paused=paused)
            self.index.set_state(
                entry,
                InstanceState.PAUSED if paused else InstanceState.RUNNING,
                f"restored from {state_id}",
            )
        self.index.announce_created(entry, f"restored from state {state_id}")
        return self.index.view(entry)

    # ------------------------------------------------------------------ from a snapshot

    async def clone_from_snapshot(
        self, source_id: str, snapshot: str, spec: CloneSpec, *, start: bool = True
    ) -> Instance:
        """A new instance whose disk is ``snapshot``'s disk state of ``source_id`` (cold
        boot). Needs a host whose files are local (the copy uses ``qemu-img``)."""
        validate_name(snapshot)
        src = self.index.entry(source_id)
        h = self.hosts.host(src.record.host)
        require_reachable(h)
        vol = h.volumes
        if not h.files_local or h.virtual:
            raise InvalidRequest(
                "clone_from_snapshot needs a host with local files; use "
                "capture_state/clone_from_state for remote hosts"
            )
        if self.index.get(spec.instance_id) is not None:
            raise Conflict(f"instance {spec.instance_id!r} already exists")
        dom = await lookup(h, src)
        src_definition = await dom.definition(inactive=True)
        if not await dom.has_snapshot(snapshot):
            raise NotFound(f"instance {source_id} has no snapshot {snapshot!r}")
        base = await vol.image_path(src.record.image)
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
        new = NewInstance(
            self.ctx,
            self.index,
            entry,
            f"clone of {source_id}@{snapshot}",
            stage="disk",
        )
        async with new:
            new.claim(h)
            new.allocate_port()
            overlay = vol.path("instances", f"{name}.qcow2")
            new.made_file("overlay", overlay)
            new.step("disk")
            await vol.clone_snapshot_disk(src.record.overlay, snapshot, base, overlay)
            record.overlay = overlay
            if spec.seed:
                new.tx.stage = "seed"
            await new.seed_and_serial_log(spec.seed)
            new.step("defining")
            ident = self._identity(new, spec, overlay, str(uuidlib.uuid4()))
            clone = await new.define(h.reidentify(src_definition, ident), uuid=ident.uuid)
            if start:
                new.step("booting")
                await clone.start()
                self.index.set_state(entry, InstanceState.RUNNING, "started")
        self.index.announce_created(entry, f"cloned from {source_id}@{snapshot}")
        return self.index.view(entry)
