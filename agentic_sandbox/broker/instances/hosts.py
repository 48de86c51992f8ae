"""Hypervisor hosts: the fleet's hosts by libvirt URI, and the `hosts` table that keeps the
ones added through the API across restarts."""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.access import FleetGate
from agentic_sandbox.broker.instances.errors import ConflictError, InvalidInput
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

    async def restore_draining(self) -> None:
        """After the fleet opened: hosts drained before a restart are still drained."""
        fleet = self._gate.require()
        async with self._svc.db.session() as s:
            rows = (await s.scalars(select(m.Host))).all()
            names = [r.name for r in rows if r.draining]
        for name in names:
            if name in fleet.hosts:
                fleet.set_draining(name, True)

    async def set_draining(self, who: Principal, name: str, draining: bool) -> HostInfo:
        """Stop (or resume) new placements on a host; what runs there keeps running."""
        fleet = self._gate.require()
        changed = fleet.set_draining(name, draining)
        async with self._svc.db.session() as s:
            row = await s.get(m.Host, name)
            if row is not None:
                row.draining = draining
        if changed:
            action = "host.drain" if draining else "host.undrain"
            self._svc.audit.record(who.actor, action, "host", name)
        return await fleet.host_info(name)

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
        control_address: str | None = None,
        accel: str = "auto",
        data_dir: str | None = None,
        files: str = "auto",
    ) -> HostInfo:
        """Add a host (kept, and retried while unreachable) and remember it. Its guests reach
        this server at `control_address`, which the guest link gateway must listen on."""
        settings = self._svc.settings
        if control_address is not None and not settings.guest_link_reaches(control_address):
            listening = ", ".join(settings.guest_link_hosts)
            raise InvalidInput(
                "control_address",
                f"the guest link gateway does not listen on {control_address} (it listens on "
                f"{listening}); add it to guest_link_addresses (SANDBOX_GUEST_LINK_ADDRESSES) "
                "and restart the server",
                summary="the guest link gateway does not listen there",
            )
        fleet = self._gate.require()
        capacity = Capacity(vcpus=capacity_vcpus or None, memory_mib=capacity_memory_mib or None)
        extra: dict[str, object] = {}
        if ssh_port_range:
            extra["ssh_port_range"] = list(ssh_port_range)
        if control_address is not None:
            extra["control_address"] = control_address
        if accel != "auto":
            extra["accel"] = accel
        if data_dir is not None:
            extra["data_dir"] = data_dir
        if files != "auto":
            extra["files"] = files
        try:
            spec = HostSpec(name=name, uri=uri, labels=labels, capacity=capacity, **extra)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "uri"
            raise InvalidInput(field, err["msg"]) from None
        info = await fleet.add_host(spec)
        stored: dict[str, object] = dict(labels)
        if extra:
            stored[SPEC_LABEL] = extra
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
