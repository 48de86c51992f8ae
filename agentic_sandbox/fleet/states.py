"""Saved memory states: capture, list, delete, load from a host; their frozen disks.

``capture_state`` saves a running instance's memory and copies its overlay next to it, frozen:
``states/<state>.save`` + ``states/<state>.qcow2``; the definition inside the save image is
rewritten to name the frozen disk (and a record without pool or crash history), so a clone
restored from it starts from that. The source is left shut off, or restored from the state at
once (``keep_running``).

A frozen disk is the backing file of every clone restored from its state (and of the frozen
disk of a state captured from such a clone): deleting a state removes its memory image at once
and the frozen disk with the last image backed by it (`Volumes.collect_frozen_disks`, counted
from the images' own headers, so it survives restarts). Operations on one state are serialised
by its lock (restores share its header); states whose lock is held are ``busy`` and their files
are never collected.
"""

from __future__ import annotations

import asyncio
import logging

from .context import FleetContext
from .domain_config import CloneIdentity, control_address, net_config
from .driver import HostDriver
from .errors import Conflict, FleetError, InvalidRequest
from .index import InstanceIndex
from .models import InstanceState, SavedState, utcnow, validate_name
from .transaction import Transaction

log = logging.getLogger(__name__)


def saved_state(state_id: str, host: HostDriver, save_path: str, definition: str) -> SavedState:
    facts = host.describe(definition)
    rec = facts.record
    return SavedState(
        state_id=state_id,
        host=host.name,
        save_path=save_path,
        disk_path=facts.overlay or "",
        image=rec.image if rec else "",
        loadout=rec.loadout if rec else None,
        vcpus=facts.vcpus,
        memory_mib=facts.memory_mib,
        created_at=rec.created_at if rec else utcnow(),
    )


class SavedStates:
    def __init__(self, ctx: FleetContext, index: InstanceIndex) -> None:
        self._ctx = ctx
        self._index = index
        self.saved: dict[str, SavedState] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def get(self, state_id: str) -> SavedState | None:
        return self.saved.get(state_id)

    def __contains__(self, state_id: object) -> bool:
        return state_id in self.saved

    def lock(self, state_id: str) -> asyncio.Lock:
        return self._locks.setdefault(state_id, asyncio.Lock())

    def busy(self) -> set[str]:
        """States being captured, restored from or deleted right now."""
        return {s for s, lock in self._locks.items() if lock.locked()}

    def forget_host(self, host: str) -> None:
        for sid in [s for s, st in self.saved.items() if st.host == host]:
            self.saved.pop(sid, None)

    async def list_states(self) -> list[SavedState]:
        return sorted(self.saved.values(), key=lambda s: s.state_id)

    # ------------------------------------------------------------------ capture

    def check_new(self, state_id: str) -> None:
        """A state may be captured under ``state_id``."""
        validate_name(state_id)
        if state_id in self.saved:
            raise Conflict(f"saved state {state_id!r} already exists")

    async def capture(
        self, host: HostDriver, instance_id: str, state_id: str, *, keep_running: bool = False
    ) -> SavedState:
        """Capture ``instance_id`` (on ``host``) as ``state_id`` (see the module doc)."""
        self.check_new(state_id)
        e = self._index.entry(instance_id)
        async with e.lock, self.lock(state_id):
            vol = host.volumes
            dom = await host.lookup(e.record.domain, e.uuid)
            if not await dom.is_active():
                raise InvalidRequest(f"instance {instance_id} must be running to capture it")
            save_path = vol.path("states", f"{state_id}.save")
            disk_path = vol.path("states", f"{state_id}.qcow2")
            async with Transaction() as tx:
                self._ctx.fault("save")
                tx.on_undo("save", lambda: vol.delete(save_path))
                await dom.save(save_path)
                self._index.set_state(e, InstanceState.SHUTOFF, f"memory saved as state {state_id}")
                self._ctx.fault("freeze")
                tx.on_undo("disk", lambda: vol.delete(disk_path))
                disk_path = await vol.copy(e.record.overlay, "states", f"{state_id}.qcow2")
                image = await vol.read_saved(save_path)
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
                    uuid=host.describe(image.definition).uuid,
                    overlay=disk_path,
                    serial_log=e.record.serial_log,
                    seed=None,
                    net=net_config(
                        e.record.egress,
                        e.record.agent_port,
                        e.record.ssh_port,
                        control_address(host.spec, self._ctx.config),
                    ),
                    record=record,
                )
                frozen = host.reidentify(image.definition, ident)
                await vol.write_saved(save_path, image, frozen)
                state = saved_state(state_id, host, save_path, frozen)
                if keep_running:
                    # The header now names the frozen disk; restore the source with its own
                    # definition (same UUID, its own overlay, unchanged since the save).
                    self._ctx.fault("resuming")
                    own = await dom.definition(inactive=True, secure=True)
                    await dom.restore(save_path, paused=None, definition=own)
                    self._index.set_state(
                        e, InstanceState.RUNNING, f"resumed after capturing {state_id}"
                    )
        self.saved[state_id] = state
        return state

    # ------------------------------------------------------------------ delete

    async def delete(self, host: HostDriver, st: SavedState) -> None:
        """Remove the memory image now; the frozen disk once nothing is backed by it."""
        async with self.lock(st.state_id):
            await host.volumes.delete(st.save_path)
            self.saved.pop(st.state_id, None)
        await self.collect_frozen_disks(host)

    async def collect_frozen_disks(self, host: HostDriver) -> list[str]:
        """Remove the frozen disks of deleted states that nothing on ``host`` is backed by any
        more."""
        if not host.reachable:
            return []
        removed = await host.volumes.collect_frozen_disks(self.busy())
        for name in removed:
            log.info(
                "host %s: removed %s (its state is deleted and nothing uses it)", host.name, name
            )
        return removed

    # ------------------------------------------------------------------ load

    async def load(self, host: HostDriver) -> None:
        """Take in the saved states found in ``host``'s state store."""
        vol = host.volumes
        for n in await vol.list_names("states"):
            if not n.endswith(".save"):
                continue
            state_id = n[: -len(".save")]
            if state_id in self.saved:
                continue
            path = vol.path("states", n)
            try:
                image = await vol.read_saved(path)
            except (FleetError, ValueError, OSError) as err:
                log.warning("host %s: unreadable saved state %s: %s", host.name, n, err)
                continue
            try:
                st = saved_state(state_id, host, path, image.definition)
                present = bool(st.disk_path) and await vol.exists(st.disk_path)
            except Exception:
                continue
            if present:
                self.saved[state_id] = st
