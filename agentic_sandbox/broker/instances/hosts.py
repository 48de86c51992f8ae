"""Hypervisor hosts: the fleet's hosts by libvirt URI, and the `hosts` table that keeps the
ones added through the API across restarts."""

from __future__ import annotations

from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.access import FleetGate
from agentic_sandbox.broker.instances.errors import ConflictError
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import Capacity, HostInfo, HostSpec

LOCAL_HOST = "local"
SPEC_LABEL = "_spec"  # the label under which a host row keeps the spec's other fields


def host_spec_from_row(row: m.Host) -> HostSpec:
    labels = dict(row.labels or {})
    stored = labels.pop(SPEC_LABEL) if isinstance(labels.get(SPEC_LABEL), dict) else {}
    capacity = Capacity(
        vcpus=row.capacity_vcpus or None, memory_mib=row.capacity_memory_mib or None
    )
    return HostSpec(name=row.name, uri=row.uri, labels=labels, capacity=capacity, **stored)


class HostService:
    def __init__(self, svc: Services, gate: FleetGate) -> None:
        self._svc = svc
        self._gate = gate

    async def specs(self) -> list[HostSpec]:
        """The hosts the fleet opens with: the local one (`SANDBOX_LIBVIRT_URI`, given a row
        on first start) and every host added before."""
        settings = self._svc.settings
        specs = [
            HostSpec(
                name=LOCAL_HOST,
                uri=settings.libvirt_uri,
                accel="auto" if settings.kvm_probe else "tcg",
            )
        ]
        async with self._svc.db.session() as s:
            rows = (await s.scalars(select(m.Host))).all()
            specs += [host_spec_from_row(row) for row in rows if row.name != LOCAL_HOST]
            if not any(r.name == LOCAL_HOST for r in rows):
                s.add(m.Host(name=LOCAL_HOST, uri=settings.libvirt_uri, labels={}, owner="admin"))
        return specs

    async def list_hosts(self) -> list[HostInfo]:
        return await self._gate.require().list_hosts()

    async def host_info(self, name: str) -> HostInfo:
        return await self._gate.require().host_info(name)

    async def add(
        self,
        who: Principal,
        *,
        name: str,
        uri: str,
        labels: dict[str, str],
        capacity_vcpus: int | None = None,
        capacity_memory_mib: int | None = None,
        ssh_port_range: tuple[int, int] | None = None,
    ) -> HostInfo:
        """Add a host (kept, and retried while unreachable) and remember it."""
        fleet = self._gate.require()
        capacity = Capacity(vcpus=capacity_vcpus or None, memory_mib=capacity_memory_mib or None)
        spec = HostSpec(
            name=name,
            uri=uri,
            labels=labels,
            capacity=capacity,
            **({"ssh_port_range": ssh_port_range} if ssh_port_range else {}),
        )
        info = await fleet.add_host(spec)
        stored: dict[str, object] = dict(labels)
        if ssh_port_range:
            stored[SPEC_LABEL] = {"ssh_port_range": list(ssh_port_range)}
        async with self._svc.db.session() as s:
            row = await s.get(m.Host, name)
            if row is None:
                row = m.Host(name=name, uri=uri, owner=who.subject)
                s.add(row)
            row.labels = stored
            row.capacity_vcpus = capacity_vcpus
            row.capacity_memory_mib = capacity_memory_mib
            row.state = "reachable" if info.reachable else "unreachable"
            row.state_reason = info.reason
        self._svc.audit.record(who.actor, "host.add", "host", name, detail={"uri": uri})
        return info

    async def remove(self, who: Principal, name: str, *, force: bool = False) -> None:
        """Remove a host (the fleet refuses while it has instances, unless `force`)."""
        fleet = self._gate.require()
        if name == LOCAL_HOST:
            raise ConflictError(
                "the local host cannot be removed (set SANDBOX_LIBVIRT_URI instead)"
            )
        await fleet.remove_host(name, force=force)
        async with self._svc.db.session() as s:
            row = await s.get(m.Host, name)
            if row is not None:
                await s.delete(row)
        self._svc.audit.record(who.actor, "host.remove", "host", name)
