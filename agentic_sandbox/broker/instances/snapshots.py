"""Snapshots of instances: the fleet's snapshots and saved states, and the `snapshots` table.

A memory snapshot is two things in the fleet: a saved state (the memory image and a frozen
disk — what clones restore) and an internal qcow2 snapshot (what revert goes back to). Its row
keeps the state's id; deleting the snapshot deletes the state through the fleet, which removes
the memory image at once and the frozen disk with the last clone backed by it.
"""

from __future__ import annotations

import re
import uuid

from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.access import (
    FleetGate,
    changeable_instance,
    require_owner_or_admin,
    visible_instance,
)
from agentic_sandbox.broker.instances.errors import ConflictError, InvalidInput, NotFoundError
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m


def state_id_of(snap: m.Snapshot) -> str | None:
    """The saved state of a memory snapshot (None for a disk-only one)."""
    state_id = (snap.detail or {}).get("state_id")
    return str(state_id) if state_id else None


def state_id_for(instance_id: str, name: str) -> str:
    """The fleet name of a memory snapshot's saved state."""
    state_id = f"{instance_id}--{name}"[:63].rstrip("-.")
    return re.sub(r"[^a-z0-9_.-]", "-", state_id)


class SnapshotService:
    def __init__(self, svc: Services, gate: FleetGate) -> None:
        self._svc = svc
        self._gate = gate

    async def create(
        self, who: Principal, instance_id: str, *, name: str, memory: bool, description: str
    ) -> m.Snapshot:
        """Snapshot an instance: with memory (it keeps running; clones restore the state) or
        disk-only (it must be shut off). A name is used once per instance."""
        fleet = self._gate.require()
        row = await changeable_instance(self._svc.db, who, instance_id)
        async with self._svc.db.session() as s:
            dup = await s.scalar(
                select(m.Snapshot).where(m.Snapshot.instance_id == row.id, m.Snapshot.name == name)
            )
        if dup is not None:
            raise ConflictError(f"instance {row.id} already has a snapshot {name!r}")
        detail: dict[str, object] = {"description": description}
        if memory:
            state_id = state_id_for(row.id, name)
            await fleet.capture_state(row.id, state_id, keep_running=True)
            detail["state_id"] = state_id
        info = await fleet.create_snapshot(
            row.id, name, with_memory=memory, description=description
        )
        detail["domain_state"] = info.domain_state
        snap = m.Snapshot(
            id=str(uuid.uuid4()),
            instance_id=row.id,
            name=name,
            kind="memory" if memory else "disk",
            owner=row.owner,
            detail=detail,
        )
        async with self._svc.db.session() as s:
            s.add(snap)
        self._svc.audit.record(
            who.actor, "snapshot.create", "instance", row.id, detail={"name": name}
        )
        return snap

    async def rows(self, instance_id: str) -> list[m.Snapshot]:
        """An instance's snapshots, oldest first (no visibility check: the caller's job)."""
        async with self._svc.db.session() as s:
            return list(
                (
                    await s.scalars(
                        select(m.Snapshot)
                        .where(m.Snapshot.instance_id == instance_id)
                        .order_by(m.Snapshot.created_at)
                    )
                ).all()
            )

    async def of_instance(self, who: Principal, instance_id: str) -> list[m.Snapshot]:
        row = await visible_instance(self._svc.db, who, instance_id)
        return await self.rows(row.id)

    async def forget(self, snaps: list[m.Snapshot]) -> None:
        """Drop the rows of snapshots whose states the fleet has deleted."""
        async with self._svc.db.session() as s:
            for snap in snaps:
                live = await s.get(m.Snapshot, snap.id)
                if live is not None:
                    await s.delete(live)

    async def _find(
        self, who: Principal, instance_id: str, name: str
    ) -> tuple[m.Instance, m.Snapshot]:
        row = await visible_instance(self._svc.db, who, instance_id)
        async with self._svc.db.session() as s:
            snap = await s.scalar(
                select(m.Snapshot).where(m.Snapshot.instance_id == row.id, m.Snapshot.name == name)
            )
        if snap is None:
            raise NotFoundError("snapshot", f"{row.id}/{name}")
        return row, snap

    async def memory_state(self, who: Principal, instance_id: str, name: str) -> str:
        """The saved state a create `from_snapshot` restores; a disk-only snapshot has none."""
        _row, snap = await self._find(who, instance_id, name)
        state_id = state_id_of(snap)
        if snap.kind != "memory" or not state_id:
            raise InvalidInput(
                "from_snapshot",
                f"{instance_id}/{name} has no memory state to restore; take a snapshot with memory",
            )
        return state_id

    async def revert(self, who: Principal, instance_id: str, name: str) -> m.Instance:
        """Go back to a snapshot; the instance's row, with the state it is in now."""
        fleet = self._gate.require()
        row, snap = await self._find(who, instance_id, name)
        require_owner_or_admin(who, row)
        inst = await fleet.revert_snapshot(row.id, snap.name)
        self._svc.audit.record(
            who.actor, "snapshot.revert", "instance", row.id, detail={"name": snap.name}
        )
        async with self._svc.db.session() as s:
            fresh = await s.get(m.Instance, row.id)
            assert fresh is not None
            fresh.state = inst.state.value
        return fresh

    async def delete(self, who: Principal, instance_id: str, name: str) -> None:
        """Delete a snapshot: clones made from it keep running (its frozen disk goes with the
        last of them). A failure in the fleet keeps the row, so the delete can be retried."""
        fleet = self._gate.require()
        row, snap = await self._find(who, instance_id, name)
        require_owner_or_admin(who, row)
        state_id = state_id_of(snap)
        if state_id:
            await fleet.delete_state(state_id)
        await fleet.delete_snapshot(row.id, snap.name)
        await self.forget([snap])
        self._svc.audit.record(
            who.actor, "snapshot.delete", "instance", row.id, detail={"name": snap.name}
        )
