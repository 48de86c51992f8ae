"""Internal snapshots: create (with memory or disk-only), list, revert, delete.

Internal snapshots live inside the instance's overlay, so deleting the instance removes them with
it. libvirt 9 reverts internal snapshots (it cannot revert external ones), so these are what the
fleet uses. A running instance's snapshot includes its memory (QEMU ``savevm``); a disk-only
snapshot needs the instance shut off.
"""

from __future__ import annotations

from dataclasses import dataclass

from .context import FleetContext
from .errors import InvalidRequest, NotFound
from .hosts import HostRegistry
from .index import InstanceIndex
from .lifecycle import lookup
from .models import (
    FleetEventKind,
    Instance,
    InstanceRecord,
    InstanceState,
    SnapshotInfo,
    validate_name,
)


def refuse_pool_member(record: InstanceRecord) -> None:
    """No snapshot or saved state of a warm-pool member: its memory may hold the key its agent
    made standing by, which a restore would give every clone (it is only ever used by the
    member's own hand-off; this keeps it out of saved memory altogether)."""
    if record.pool is not None:
        raise InvalidRequest(
            f"instance {record.instance_id!r} is a member of warm pool {record.pool!r}; "
            "take it from the pool first"
        )


@dataclass(eq=False)
class Snapshots:
    ctx: FleetContext
    index: InstanceIndex
    hosts: HostRegistry

    async def create_snapshot(
        self, instance_id: str, name: str, *, with_memory: bool | None = None, description: str = ""
    ) -> SnapshotInfo:
        """``with_memory``: None = memory when the instance runs, disk-only when it is off.
        Idempotent: an existing snapshot of that name is returned."""
        validate_name(name)
        e = self.index.entry(instance_id)
        refuse_pool_member(e.record)
        async with e.lock:
            dom = await lookup(self.hosts.host(e.record.host), e)
            active = await dom.is_active()
            if with_memory is None:
                with_memory = bool(active)
            if with_memory and not active:
                raise InvalidRequest("a memory snapshot needs a running instance")
            if not with_memory and active:
                raise InvalidRequest(
                    "a disk-only internal snapshot needs the instance shut off (libvirt 9 "
                    "cannot take one of a running QEMU); take a memory snapshot instead"
                )
            info = await dom.create_snapshot(instance_id, name, description, with_memory)
        self.ctx.emit(
            FleetEventKind.SNAPSHOT_CREATED,
            host=e.record.host,
            instance_id=instance_id,
            incarnation=e.record.incarnation,
            detail=name,
        )
        return info

    async def list_snapshots(self, instance_id: str) -> list[SnapshotInfo]:
        e = self.index.entry(instance_id)
        dom = await lookup(self.hosts.host(e.record.host), e)
        return sorted(await dom.list_snapshots(instance_id), key=lambda s: (s.created_at, s.name))

    async def revert_snapshot(
        self, instance_id: str, name: str, *, paused: bool = False
    ) -> Instance:
        """Go back to a snapshot: a memory snapshot resumes exactly where it was taken
        (``paused`` leaves it paused); a disk-only one leaves the instance shut off."""
        validate_name(name)
        e = self.index.entry(instance_id)
        refuse_pool_member(e.record)
        async with e.lock:
            dom = await lookup(self.hosts.host(e.record.host), e)
            try:
                status = await dom.revert_snapshot(name, paused=paused)
            except NotFound as err:
                raise NotFound(f"instance {instance_id} has no snapshot {name!r}") from err
            self.index.set_state(e, status.state, "observed")
            if e.state is InstanceState.RUNNING:
                e.reason = f"reverted to {name}"
        self.ctx.emit(
            FleetEventKind.SNAPSHOT_REVERTED,
            host=e.record.host,
            instance_id=instance_id,
            incarnation=e.record.incarnation,
            state=e.state,
            detail=name,
        )
        return self.index.view(e)

    async def delete_snapshot(self, instance_id: str, name: str) -> None:
        """Idempotent: deleting a snapshot that does not exist succeeds."""
        validate_name(name)
        e = self.index.entry(instance_id)
        refuse_pool_member(e.record)
        async with e.lock:
            dom = await lookup(self.hosts.host(e.record.host), e)
            removed = await dom.delete_snapshot(name)
        if removed:
            self.ctx.emit(
                FleetEventKind.SNAPSHOT_DELETED,
                host=e.record.host,
                instance_id=instance_id,
                incarnation=e.record.incarnation,
                detail=name,
            )
