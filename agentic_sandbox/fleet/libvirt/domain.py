"""`LibvirtDomain`: the driver protocol's `Domain` over a ``virDomain``.

Each method is one trip to the executor (`LibvirtHost.run`), as the fleet made them before the
driver seam; composite steps (find-or-create a snapshot, revert then read the state) run as one
blocking function so they cost one hop.
"""

from __future__ import annotations

import contextlib
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import libvirt

from ..driver import DomainStatus
from ..errors import LibvirtFailure, NotFound
from ..models import InstanceRecord, SnapshotInfo
from .domain_xml import METADATA_NS, METADATA_PREFIX, record_metadata_xml
from .events import domain_status

if TYPE_CHECKING:
    from .host import LibvirtHost

_UNDEFINE_ALL = (
    libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
    | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
    | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
    | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
)
_UNDEFINE_BASIC = (
    libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
)


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


def cdrom_xml(domain_xml: str, path: str | None) -> str:
    """The seed drive's ``<disk>`` of a domain, with ``path`` as its medium (None: empty)."""
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


class LibvirtDomain:
    def __init__(self, host: LibvirtHost, dom: libvirt.virDomain) -> None:
        self._host = host
        self._dom = dom
        self.name: str = dom.name()  # kept by the handle: no call to libvirtd

    async def uuid(self) -> str:
        return str(await self._host.run(self._dom.UUIDString))

    async def is_active(self) -> bool:
        return bool(await self._host.run(self._dom.isActive))

    async def status(self) -> DomainStatus:
        st, reason = await self._host.run(self._dom.state)
        return domain_status(st, reason)

    async def start(self) -> None:
        await self._host.run(self._dom.create)

    async def shutdown(self) -> None:
        await self._host.run(self._dom.shutdown)

    async def destroy(self) -> None:
        await self._host.run(self._dom.destroy)

    async def reboot(self) -> None:
        await self._host.run(self._dom.reboot, 0)

    async def reset(self) -> None:
        await self._host.run(self._dom.reset, 0)

    async def suspend(self) -> None:
        await self._host.run(self._dom.suspend)

    async def resume(self) -> None:
        await self._host.run(self._dom.resume)

    async def remove(self) -> None:
        await self._host.run(remove_domain, self._dom)

    async def definition(self, *, inactive: bool = False, secure: bool = False) -> str:
        flags = libvirt.VIR_DOMAIN_XML_INACTIVE if inactive else 0
        if secure:
            flags |= libvirt.VIR_DOMAIN_XML_SECURE
        return str(await self._host.run(self._dom.XMLDesc, flags))

    async def set_record(self, record: InstanceRecord) -> None:
        await self._host.run(save_record, self._dom, record)

    async def change_media(self, seed: str | None) -> None:
        xml = await self._host.run(self._dom.XMLDesc, 0)
        cd = cdrom_xml(xml, seed)
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
        if await self._host.run(self._dom.isActive):
            # FORCE: eject even when the guest has the tray locked (a reader of the device
            # holds it); the guest sees a media change either way.
            flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE | libvirt.VIR_DOMAIN_DEVICE_MODIFY_FORCE
        await self._host.run(self._dom.updateDeviceFlags, cd, flags)

    async def save(self, path: str) -> None:
        await self._host.run(self._dom.save, path)

    async def restore(
        self, path: str, *, paused: bool | None, definition: str | None = None
    ) -> None:
        """``paused`` None: as the image was saved. libvirt's test driver takes neither
        replacement XML nor the paused flag; its domains are not real, so the header's XML
        and a suspend after the restore are equivalent there."""
        conn, _ = self._host.require()
        if self._host.virtual:
            await self._host.run(conn.restoreFlags, path, None, 0)
            if paused:
                await self._host.run(self._dom.suspend)
            return
        flags = 0
        if paused is not None:
            flags = libvirt.VIR_DOMAIN_SAVE_PAUSED if paused else libvirt.VIR_DOMAIN_SAVE_RUNNING
        await self._host.run(conn.restoreFlags, path, definition, flags)

    # ------------------------------------------------------------------ snapshots

    async def create_snapshot(
        self, instance_id: str, name: str, description: str, with_memory: bool
    ) -> SnapshotInfo:
        dom = self._dom

        def make() -> SnapshotInfo:
            try:
                snap = dom.snapshotLookupByName(name, 0)
            except libvirt.libvirtError as err:
                if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT:
                    raise
                snap = dom.snapshotCreateXML(snapshot_xml(name, description, with_memory), 0)
            return parse_snapshot(instance_id, snap.getXMLDesc(0), _is_current(snap))

        return await self._host.run(make)

    async def has_snapshot(self, name: str) -> bool:
        try:
            await self._host.run(self._dom.snapshotLookupByName, name, 0)
        except NotFound:
            return False
        return True

    async def list_snapshots(self, instance_id: str) -> list[SnapshotInfo]:
        dom = self._dom

        def listing() -> list[SnapshotInfo]:
            return [
                parse_snapshot(instance_id, s.getXMLDesc(0), _is_current(s))
                for s in dom.listAllSnapshots(0)
            ]

        return await self._host.run(listing)

    async def revert_snapshot(self, name: str, *, paused: bool) -> DomainStatus:
        dom = self._dom

        def revert() -> tuple[int, int]:
            snap = dom.snapshotLookupByName(name, 0)
            flags = libvirt.VIR_DOMAIN_SNAPSHOT_REVERT_PAUSED if paused else 0
            dom.revertToSnapshot(snap, flags)
            st, reason = dom.state()
            return st, reason

        st, reason = await self._host.run(revert)
        return domain_status(st, reason)

    async def delete_snapshot(self, name: str) -> bool:
        dom = self._dom

        def remove() -> bool:
            try:
                snap = dom.snapshotLookupByName(name, 0)
            except libvirt.libvirtError as err:
                if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT:
                    return False
                raise
            snap.delete(0)
            return True

        return await self._host.run(remove)
