"""The `instances` and `hosts` tables as mirrors of the fleet.

libvirt is the truth about domains (their facts live in each domain's metadata); the tables
serve the API (owners, listing, filters). Fleet events reach them through one queue with one
consumer, so the mirror sees each instance's events in order; every change of an instance's
state is audited and every event republished as `instance.*` / `host.*`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from sqlalchemy import select

from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import Fleet, FleetEvent, InstanceRecord

log = logging.getLogger(__name__)

HOST_LIST_EVENTS = (
    "host.unreachable",
    "host.reconnected",
    "host.added",
    "host.removed",
    "host.draining",
    "host.undrained",
)


def apply_record(row: m.Instance, rec: InstanceRecord, state: str, reason: str) -> None:
    """Copy the fleet's facts about an instance onto its row."""
    row.host = rec.host
    row.image = rec.image.removesuffix(".qcow2") if rec.image else row.image
    row.loadout = rec.loadout or row.loadout
    row.vcpus = rec.vcpus
    row.memory_mib = rec.memory_mib
    row.ssh_port = rec.ssh_port
    row.network_policy = rec.egress.value
    row.state = state
    row.state_reason = reason
    spec = dict(row.spec or {})
    spec["fleet_record"] = rec.model_dump(mode="json")
    row.spec = spec


class InstanceMirror:
    def __init__(self, svc: Services, fleet: Fleet) -> None:
        self._svc = svc
        self._fleet = fleet
        self._queue: asyncio.Queue[FleetEvent] = asyncio.Queue(maxsize=100_000)
        self._tasks: set[asyncio.Task[None]] = set()
        self._hosts_reachable: dict[tuple[str, ...], float] = {}
        svc.metrics.provide(
            "sandbox_hosts",
            "Hypervisor hosts by reachability",
            ("state",),
            self._host_gauge,
        )

    def start(self) -> None:
        self._spawn(self._loop())

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- what the fleet opens with, and agreeing with what it found --------------------------
    async def known_records(self) -> list[InstanceRecord]:
        """The fleet records of the live rows (the fleet adopts their domains at open)."""
        out = []
        async with self._svc.db.session() as s:
            rows = (
                await s.scalars(select(m.Instance).where(m.Instance.deleted_at.is_(None)))
            ).all()
        for row in rows:
            rec = (row.spec or {}).get("fleet_record")
            if rec:
                try:
                    out.append(InstanceRecord.model_validate(rec))
                except Exception:
                    log.warning("ignoring an unreadable fleet record for %s", row.id)
        return out

    async def sync(self) -> None:
        """After open/reconcile: make the table agree with what the fleet found."""
        instances = await self._fleet.list_instances()
        async with self._svc.db.session() as s:
            for inst in instances:
                row = await s.get(m.Instance, inst.instance_id)
                if row is None:
                    row = m.Instance(
                        id=inst.instance_id,
                        incarnation=inst.record.incarnation or m.new_incarnation(),
                        owner=inst.record.owner or "admin",
                        state=inst.state.value,
                    )
                    s.add(row)
                elif inst.record.incarnation and inst.record.incarnation != row.incarnation:
                    log.warning(
                        "domain of %s records incarnation %s, the database %s",
                        inst.instance_id,
                        inst.record.incarnation,
                        row.incarnation,
                        extra={"instance_id": inst.instance_id},
                    )
                apply_record(row, inst.record, inst.state.value, inst.state_reason)

    # ---- fleet events -------------------------------------------------------------------------
    def on_event(self, ev: FleetEvent) -> None:
        """The fleet's event callback (on the loop, must not block)."""
        kind = ev.kind.value
        if kind.startswith("host."):
            self._svc.events.publish(kind, host=ev.host, data={"detail": ev.detail})
            if kind in HOST_LIST_EVENTS:
                self._spawn(self._refresh_hosts())
            return
        if ev.instance_id is None:
            if kind.startswith(("fleet.", "pool.", "image.")):
                log.info("fleet: %s %s", kind, ev.detail)
            return
        try:
            self._queue.put_nowait(ev)  # one consumer: the mirror sees events in order
        except asyncio.QueueFull:
            log.error("fleet event backlog full; dropped %s for %s", kind, ev.instance_id)

    async def _loop(self) -> None:
        while True:
            ev = await self._queue.get()
            try:
                await self._mirror(ev)
            except Exception:
                log.exception("mirroring %s failed", ev.kind.value)

    async def _mirror(self, ev: FleetEvent) -> None:
        assert ev.instance_id is not None
        kind = ev.kind.value
        owner: str | None = None
        async with self._svc.db.session() as s:
            row = await s.get(m.Instance, ev.instance_id)
            if row is not None:
                owner = row.owner
            # A deleted VM's row is not touched: the fleet deletes only when the server asks,
            # and whoever asked ends the instance itself (`end_instance`, or `abandon` for a
            # provision) — a row marked deleted here would make that skip the incarnation.
            # Nor is a row the event is not about: an instance already ended (a late event of
            # its last moments), or another incarnation under the same id.
            if (
                row is not None
                and ev.state is not None
                and kind != "instance.deleted"
                and row.deleted_at is None
                and (ev.incarnation is None or ev.incarnation == row.incarnation)
            ):
                before = row.state
                if row.state != "provisioning":  # a provision's outcome is its own to record
                    row.state = ev.state.value
                row.state_reason = ev.detail
                if row.state != before:
                    self._svc.audit.transition(
                        "fleet", "instance", row.id, before, row.state, cause=ev.detail or kind
                    )
        if not kind.startswith("instance."):  # snapshot.created → instance.snapshot_created
            kind = "instance." + kind.replace(".", "_")
        self._svc.events.publish(
            kind,
            actor="fleet",
            instance_id=ev.instance_id,
            host=ev.host,
            owner=owner,
            data={"state": ev.state.value if ev.state else None, "detail": ev.detail},
        )

    # ---- hosts --------------------------------------------------------------------------------
    async def _refresh_hosts(self) -> None:
        hosts = await self._fleet.list_hosts()
        counts: dict[tuple[str, ...], float] = {("reachable",): 0.0, ("unreachable",): 0.0}
        async with self._svc.db.session() as s:
            for info in hosts:
                counts[("reachable" if info.reachable else "unreachable",)] += 1
                row = await s.get(m.Host, info.spec.name)
                if row is not None:
                    row.state = "reachable" if info.reachable else "unreachable"
                    row.state_reason = info.reason
        self._hosts_reachable = counts

    def _host_gauge(self) -> dict[tuple[str, ...], float]:
        return self._hosts_reachable
