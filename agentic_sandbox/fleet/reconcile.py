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

import logging
from dataclasses import dataclass

from .context import FleetContext
from .driver import HostDriver
from .index import Entry, InstanceIndex
from .models import (
    DOMAIN_PREFIX,
    FleetEventKind,
    InstanceRecord,
    InstanceState,
    ReconcileReport,
)
from .states import SavedStates

log = logging.getLogger(__name__)


def owns(host: HostDriver, rec: InstanceRecord) -> bool:
    """Whether a fleet domain is this fleet's: its disk lives in this fleet's data directory.
    Fleets with other data directories (another server, a test run, provision-vm.sh with
    --data-dir) may share the host; their domains are theirs to adopt, change and delete."""
    vol = host.volumes
    return any(p and vol.holds("instances", p) for p in (rec.overlay, rec.serial_log))


@dataclass(eq=False)
class Reconciler:
    ctx: FleetContext
    index: InstanceIndex
    states: SavedStates

    async def reconcile_host(self, h: HostDriver) -> ReconcileReport:
        scans = await h.list_domains()
        report = ReconcileReport(host=h.name)
        seen: set[str] = set()
        domain_names = {s.name for s in scans}
        for s in scans:
            if not s.name.startswith(DOMAIN_PREFIX):
                report.foreign.append(s.name)
                continue
            rec: InstanceRecord | None
            try:
                rec = h.describe(s.definition).record
            except Exception as err:  # corrupt metadata: not ours to touch
                log.warning("host %s: domain %s has unreadable metadata: %s", h.name, s.name, err)
                rec = None
            if rec is None or not owns(h, rec):
                report.foreign.append(s.name)  # not a fleet's, or another data directory's
                continue
            rec = rec.model_copy(update={"host": h.name, "domain": s.name})
            state = s.status.state
            e = self.index.get(rec.instance_id)
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
                self.index.add(e)
                report.adopted.append(rec.instance_id)
                self.ctx.emit(
                    FleetEventKind.INSTANCE_ADOPTED,
                    host=h.name,
                    instance_id=rec.instance_id,
                    incarnation=rec.incarnation,
                    state=state,
                    detail=f"domain {s.name} found in libvirt",
                )
                continue
            if e.deleting or self.index.busy(h.name, s.name):
                continue
            e.uuid = s.uuid
            if e.record.domain != s.name or e.state in (InstanceState.UNKNOWN, InstanceState.LOST):
                e.record = rec
            if e.state != state:
                report.states_changed.append(rec.instance_id)
            self.index.set_state(e, state, "reconciled")

        for e in self.index.on_host(h.name):
            if e.record.instance_id in seen or e.deleting:
                continue
            if self.index.busy(h.name, e.record.domain):
                continue
            if e.state is not InstanceState.LOST:
                report.lost.append(e.record.instance_id)
                self.index.set_state(e, InstanceState.LOST, "domain no longer exists in libvirt")

        report.orphans_removed.extend(await self._remove_orphans(h, domain_names))
        await self.states.load(h)
        return report

    async def _remove_orphans(self, h: HostDriver, domains: set[str]) -> list[str]:
        indexed = {e.record.domain for e in self.index.on_host(h.name)}
        busy = {d for (host, d) in self.index.inflight if host == h.name}
        removed = await h.volumes.sweep_orphans(domains | busy | indexed, self.states.busy())
        for n in removed:
            self.ctx.emit(FleetEventKind.ORPHAN_REMOVED, host=h.name, detail=n)
        return removed
