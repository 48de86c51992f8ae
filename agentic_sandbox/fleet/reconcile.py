"""Reconciliation: make the fleet's index agree with what libvirt has.

Run when a host connects (fleet start, host added, libvirtd came back):

* a fleet domain (name ``sbx-…`` with the fleet's ``<metadata>``) the index does not know is
  adopted — when its disk is in this fleet's data directory: fleets with other data
  directories on the same libvirtd (another server, a test run) keep their own;
* an indexed instance whose domain is gone is marked ``lost`` (kept until deleted, so the layer
  above decides);
* known instances take the state libvirt reports (events only for real changes);
* files in the host's instance store that belong to no domain are removed (never while the fleet
  is making or removing that domain), and frozen disks of deleted or half-written saved states
  once no image is backed by them;
* saved states found in the host's state store are loaded.

Domains without the prefix or the metadata are someone else's and are left alone.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import libvirt

from .clones import read_save_header, state_from_xml
from .connection import HostConnection
from .core import Entry, FleetBase
from .disks import HostStorage
from .domain_xml import parse_record
from .errors import FleetError
from .events import state_from_domain
from .models import (
    DOMAIN_PREFIX,
    FleetEventKind,
    InstanceRecord,
    InstanceState,
    ReconcileReport,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DomainScan:
    name: str
    uuid: str
    state: int
    reason: int
    xml: str


def scan_domains(conn: libvirt.virConnect) -> list[DomainScan]:
    out = []
    for dom in conn.listAllDomains(0):
        try:
            st, reason = dom.state()
            out.append(DomainScan(dom.name(), dom.UUIDString(), st, reason, dom.XMLDesc(0)))
        except libvirt.libvirtError as e:  # vanished while listing
            if e.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise
    return out


def owns(storage: HostStorage, rec: InstanceRecord) -> bool:
    """Whether a fleet domain is this fleet's: its disk lives in this fleet's data directory.
    Fleets with other data directories (another server, a test run, provision-vm.sh with
    --data-dir) may share the libvirtd; their domains are theirs to adopt, change and delete."""
    inst_dir = storage.dirs.get("instances", "").rstrip("/") + "/"
    return any(p and p.startswith(inst_dir) for p in (rec.overlay, rec.serial_log))


class ReconcileOps(FleetBase):
    async def reconcile(self, host: str | None = None) -> list[ReconcileReport]:
        names = [host] if host else list(self.hosts)
        reports = []
        for name in names:
            h = self.host(name)
            if h.conn is None:
                continue
            reports.append(await self.reconcile_host(h))
        return reports

    async def reconcile_host(self, h: HostConnection) -> ReconcileReport:
        conn, storage = h.require()
        scans = await h.run(scan_domains, conn)
        report = ReconcileReport(host=h.name)
        seen: set[str] = set()
        domain_names = {s.name for s in scans}
        for s in scans:
            if not s.name.startswith(DOMAIN_PREFIX):
                report.foreign.append(s.name)
                continue
            try:
                rec = parse_record(s.xml)
            except Exception as err:  # corrupt metadata: not ours to touch
                log.warning("host %s: domain %s has unreadable metadata: %s", h.name, s.name, err)
                rec = None
            if rec is None or not owns(storage, rec):
                report.foreign.append(s.name)  # not a fleet's, or another data directory's
                continue
            rec = rec.model_copy(update={"host": h.name, "domain": s.name})
            state = state_from_domain(s.state, s.reason)
            e = self.entries.get(rec.instance_id)
            if e is not None and e.record.host != h.name:
                log.warning(
                    "instance %s found on %s but indexed on %s; leaving it",
                    rec.instance_id,
                    h.name,
                    e.record.host,
                )
                report.foreign.append(s.name)
                continue
            seen.add(rec.instance_id)
            if rec.ssh_port is not None:
                h.ports.claim(rec.ssh_port)
            if e is None:
                e = Entry(record=rec, state=state, uuid=s.uuid, reason="adopted")
                self.entries[rec.instance_id] = e
                report.adopted.append(rec.instance_id)
                self.emit(
                    FleetEventKind.INSTANCE_ADOPTED,
                    host=h.name,
                    instance_id=rec.instance_id,
                    state=state,
                    detail=f"domain {s.name} found in libvirt",
                )
                continue
            if e.deleting or (h.name, s.name) in self.inflight:
                continue
            e.uuid = s.uuid
            if e.record.domain != s.name or e.state in (InstanceState.UNKNOWN, InstanceState.LOST):
                e.record = rec
            if e.state != state:
                report.states_changed.append(rec.instance_id)
            self.set_state(e, state, "reconciled")

        for e in list(self.entries.values()):
            if e.record.host != h.name or e.record.instance_id in seen or e.deleting:
                continue
            if (h.name, e.record.domain) in self.inflight:
                continue
            if e.state is not InstanceState.LOST:
                report.lost.append(e.record.instance_id)
                self.set_state(e, InstanceState.LOST, "domain no longer exists in libvirt")

        report.orphans_removed.extend(await self._remove_orphans(h, domain_names))
        await self._load_states(h)
        return report

    async def _remove_orphans(self, h: HostConnection, domains: set[str]) -> list[str]:
        _, storage = h.require()
        lost_domains = {e.record.domain for e in self.entries.values() if e.record.host == h.name}
        busy = {d for (host, d) in self.inflight if host == h.name}
        busy_states = self.busy_states()

        def sweep() -> list[str]:
            removed = []
            for n in storage.list_names("instances"):
                owner = n.split(".", 1)[0]
                if not owner.startswith(DOMAIN_PREFIX):
                    continue
                if owner in domains or owner in busy or owner in lost_domains:
                    continue
                if storage.delete(storage.path("instances", n)):
                    removed.append(n)
            # frozen disks of deleted or half-written states, once nothing is backed by them
            removed.extend(storage.collect_frozen_disks(busy_states))
            return removed

        removed = await h.run(sweep)
        for n in removed:
            self.emit(FleetEventKind.ORPHAN_REMOVED, host=h.name, detail=n)
        return removed

    async def _load_states(self, h: HostConnection) -> None:
        _, storage = h.require()
        names = await h.run(storage.list_names, "states")
        for n in names:
            if not n.endswith(".save"):
                continue
            state_id = n[: -len(".save")]
            if state_id in self.saved_states:
                continue
            path = storage.path("states", n)
            try:
                header = await h.run(read_save_header, storage, path)
            except (FleetError, ValueError, OSError) as err:
                log.warning("host %s: unreadable saved state %s: %s", h.name, n, err)
                continue
            with contextlib.suppress(Exception):
                st = state_from_xml(state_id, h.name, path, header.xml)
                present: bool = bool(st.disk_path) and await h.run(storage.exists, st.disk_path)
                if present:
                    self.saved_states[state_id] = st
