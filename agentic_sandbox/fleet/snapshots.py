"""Internal qcow2 snapshots: create (with memory or disk-only), list, revert, delete.

Internal snapshots live inside the instance's overlay, so deleting the instance removes them with
it. libvirt 9 reverts internal snapshots (it cannot revert external ones), so these are what the
fleet uses. A running instance's snapshot includes its memory (QEMU ``savevm``); a disk-only
snapshot needs the instance shut off.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime

import libvirt

from .core import FleetBase
from .errors import InvalidRequest, NotFound
from .models import FleetEventKind, Instance, InstanceState, SnapshotInfo, validate_name


def snapshot_xml(name: str, description: str, with_memory: bool) -> str:
    root = ET.Element("domainsnapshot")
    ET.SubElement(root, "name").text = name
    if description:
        ET.SubElement(root, "description").text = description
    ET.SubElement(root, "memory", {"snapshot": "internal" if with_memory else "no"})
    return ET.tostring(root, encoding="unicode")


def parse_snapshot(instance_id: str, xml: str, current: bool = False) -> SnapshotInfo:
    root = ET.fromstring(xml)
    mem = root.find("memory")
    state = root.findtext("state", "")
    with_memory = (mem is not None and mem.get("snapshot") == "internal") or (
        mem is None and state in ("running", "paused")
    )
    created = int(root.findtext("creationTime", "0") or 0)
    return SnapshotInfo(
        instance_id=instance_id,
        name=root.findtext("name", ""),
        created_at=datetime.fromtimestamp(created, UTC),
        with_memory=with_memory,
        domain_state=state,
        description=root.findtext("description", "") or "",
        parent=root.findtext("parent/name"),
        current=current,
    )


def _is_current(snap: libvirt.virDomainSnapshot) -> bool:
    try:
        return bool(snap.isCurrent(0))
    except libvirt.libvirtError:
        return False


class SnapshotOps(FleetBase):
    async def create_snapshot(
        self, instance_id: str, name: str, *, with_memory: bool | None = None, description: str = ""
    ) -> SnapshotInfo:
        """``with_memory``: None = memory when the instance runs, disk-only when it is off.
        Idempotent: an existing snapshot of that name is returned."""
        validate_name(name)
        e = self.entry(instance_id)
        async with e.lock:
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)
            active = await h.run(dom.isActive)
            if with_memory is None:
                with_memory = bool(active)
            if with_memory and not active:
                raise InvalidRequest("a memory snapshot needs a running instance")
            if not with_memory and active:
                raise InvalidRequest(
                    "a disk-only internal snapshot needs the instance shut off (libvirt 9 "
                    "cannot take one of a running QEMU); take a memory snapshot instead"
                )

            def make() -> SnapshotInfo:
                try:
                    snap = dom.snapshotLookupByName(name, 0)
                except libvirt.libvirtError as err:
                    if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT:
                        raise
                    snap = dom.snapshotCreateXML(snapshot_xml(name, description, with_memory), 0)
                return parse_snapshot(instance_id, snap.getXMLDesc(0), _is_current(snap))

            info = await h.run(make)
        self.emit(
            FleetEventKind.SNAPSHOT_CREATED,
            host=e.record.host,
            instance_id=instance_id,
            detail=name,
        )
        return info

    async def list_snapshots(self, instance_id: str) -> list[SnapshotInfo]:
        e = self.entry(instance_id)
        dom = await self.lookup_domain(e)
        h = self.host(e.record.host)

        def listing() -> list[SnapshotInfo]:
            return [
                parse_snapshot(instance_id, s.getXMLDesc(0), _is_current(s))
                for s in dom.listAllSnapshots(0)
            ]

        return sorted(await h.run(listing), key=lambda s: (s.created_at, s.name))

    async def revert_snapshot(
        self, instance_id: str, name: str, *, paused: bool = False
    ) -> Instance:
        """Go back to a snapshot: a memory snapshot resumes exactly where it was taken
        (``paused`` leaves it paused); a disk-only one leaves the instance shut off."""
        validate_name(name)
        e = self.entry(instance_id)
        async with e.lock:
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)

            def revert() -> tuple[int, int]:
                snap = dom.snapshotLookupByName(name, 0)
                flags = libvirt.VIR_DOMAIN_SNAPSHOT_REVERT_PAUSED if paused else 0
                dom.revertToSnapshot(snap, flags)
                st, reason = dom.state()
                return st, reason

            try:
                st, reason = await h.run(revert)
            except NotFound as err:
                raise NotFound(f"instance {instance_id} has no snapshot {name!r}") from err
            self.observe(e, st, reason)  # type: ignore[attr-defined]
            if e.state is InstanceState.RUNNING:
                e.reason = f"reverted to {name}"
        self.emit(
            FleetEventKind.SNAPSHOT_REVERTED,
            host=e.record.host,
            instance_id=instance_id,
            state=e.state,
            detail=name,
        )
        return self.view(e)

    async def delete_snapshot(self, instance_id: str, name: str) -> None:
        """Idempotent: deleting a snapshot that does not exist succeeds."""
        validate_name(name)
        e = self.entry(instance_id)
        async with e.lock:
            dom = await self.lookup_domain(e)
            h = self.host(e.record.host)

            def remove() -> bool:
                try:
                    snap = dom.snapshotLookupByName(name, 0)
                except libvirt.libvirtError as err:
                    if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT:
                        return False
                    raise
                snap.delete(0)
                return True

            removed = await h.run(remove)
        if removed:
            self.emit(
                FleetEventKind.SNAPSHOT_DELETED,
                host=e.record.host,
                instance_id=instance_id,
                detail=name,
            )
