"""Hypervisor hosts: the fleet's hosts by libvirt URI, and the `hosts` table that keeps the
ones added through the API across restarts."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select

from agentic_sandbox.broker.agentlink import CertificateError
from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.access import FleetGate
from agentic_sandbox.broker.instances.errors import ConflictError, InvalidInput
from agentic_sandbox.broker.instances.host_credentials import HostCredentials
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import Capacity, HostInfo, HostSpec, HostUriError, parse_host_uri

log = logging.getLogger(__name__)

LOCAL_HOST = "local"
SPEC_LABEL = "_spec"  # the label under which a host row keeps the spec's other fields
CREDENTIALS_LABEL = "_credentials"  # {"tls": "server-ca"} or {"ssh_key_secret": NAME}


def host_spec_from_row(row: m.Host) -> HostSpec:
    labels = dict(row.labels or {})
    labels.pop(CREDENTIALS_LABEL, None)
    stored = labels.pop(SPEC_LABEL) if isinstance(labels.get(SPEC_LABEL), dict) else {}
    capacity = Capacity(
        vcpus=row.capacity_vcpus or None, memory_mib=row.capacity_memory_mib or None
    )
    return HostSpec(name=row.name, uri=row.uri, labels=labels, capacity=capacity, **stored)


class HostService:
    def __init__(self, svc: Services, gate: FleetGate) -> None:
        self._svc = svc
        self._gate = gate
        self.credentials = HostCredentials(svc.settings.data_dir, svc.vault)

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
            for row in rows:
                if row.name != LOCAL_HOST:
                    specs.append(await self._with_credentials(row, host_spec_from_row(row)))
            if not any(r.name == LOCAL_HOST for r in rows):
                s.add(m.Host(name=LOCAL_HOST, uri=settings.libvirt_uri, labels={}, owner="admin"))
        return specs

    async def _with_credentials(self, row: m.Host, spec: HostSpec) -> HostSpec:
        """A stored host's spec with its credential files written again (a server-CA client
        certificate renewed when due; an SSH key from the vault). A host whose credentials
        cannot be made is still opened: it stays unreachable, with the reason logged."""
        kind = (row.labels or {}).get(CREDENTIALS_LABEL)
        if not isinstance(kind, dict):
            return spec
        update: dict[str, Any] = {}
        try:
            if kind.get("tls") == "server-ca":
                update["tls_pki_dir"] = self.credentials.server_ca_pki(row.name)
            secret = kind.get("ssh_key_secret")
            if isinstance(secret, str):
                key, known = await self.credentials.ssh_files(row.name, row.owner, secret, None)
                update |= {"ssh_key_file": key, "ssh_known_hosts": known}
        except (InvalidInput, OSError) as exc:
            log.warning("host %s: its credentials cannot be written: %s", row.name, exc)
            return spec
        return spec.model_copy(update=update)

    async def _credentials_for(
        self,
        who: Principal,
        name: str,
        uri: str,
        *,
        tls_pki_dir: str | None,
        ssh_key_secret: str | None,
        ssh_known_hosts: str | None,
        write: bool,
    ) -> tuple[dict[str, object], dict[str, object]]:
        """(spec fields, what the row keeps) for a new host's credentials; only files of a host
        the fleet does not have yet are written (`write`)."""
        try:
            parsed = parse_host_uri(uri)
        except HostUriError as exc:
            raise InvalidInput("uri", str(exc)) from None
        fields: dict[str, object] = {}
        kept: dict[str, object] = {}
        if tls_pki_dir is not None and not parsed.is_tls:
            raise InvalidInput("tls_pki_dir", "only for qemu+tls:// hosts")
        if (ssh_key_secret is not None or ssh_known_hosts is not None) and not parsed.is_ssh:
            raise InvalidInput("ssh_key_secret", "only for qemu+ssh:// hosts")
        if parsed.is_tls:
            if tls_pki_dir is not None:
                fields["tls_pki_dir"] = self.credentials.check_operator_pki(tls_pki_dir)
            else:
                kept = {"tls": "server-ca"}
                fields["tls_pki_dir"] = (
                    self.credentials.server_ca_pki(name)
                    if write
                    else str(self.credentials.root / name / "tls")
                )
        if parsed.is_ssh:
            if ssh_key_secret is None:
                raise InvalidInput(
                    "ssh_key_secret",
                    "a qemu+ssh:// host needs the name of a vault secret holding its private key",
                )
            kept = {"ssh_key_secret": ssh_key_secret}
            if write:
                key, known = await self.credentials.ssh_files(
                    name, who.subject, ssh_key_secret, ssh_known_hosts
                )
            else:
                key, known = self.credentials.ssh_paths(name)
            fields |= {"ssh_key_file": key, "ssh_known_hosts": known}
        return fields, kept

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

    def libvirtd_certificate(
        self, who: Principal, csr_pem: str, names: list[str]
    ) -> tuple[str, str]:
        """(CA PEM, server certificate PEM) for a libvirtd that ``qemu+tls`` URIs reach at
        `names`, signed from its CSR (its key never comes here)."""
        ca = self.credentials.ca
        try:
            cert = ca.issue_libvirtd(csr_pem.encode(), names)
        except CertificateError as exc:
            raise InvalidInput("csr_pem", str(exc)) from None
        self._svc.audit.record(
            who.actor, "host.libvirtd_certificate", "host", names[0], detail={"names": names}
        )
        return ca.certificate_pem.decode(), cert.decode()

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
        tls_pki_dir: str | None = None,
        ssh_key_secret: str | None = None,
        ssh_known_hosts: str | None = None,
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
        new = name not in fleet.hosts
        try:
            creds, kept = await self._credentials_for(
                who,
                name,
                uri,
                tls_pki_dir=tls_pki_dir,
                ssh_key_secret=ssh_key_secret,
                ssh_known_hosts=ssh_known_hosts,
                write=new,
            )
        except BaseException:
            if new:
                self.credentials.remove(name)
            raise
        if "tls_pki_dir" in creds and not kept:  # the operator's PKI: kept as given
            extra["tls_pki_dir"] = creds["tls_pki_dir"]
        try:
            spec = HostSpec(name=name, uri=uri, labels=labels, capacity=capacity, **(extra | creds))
        except ValidationError as exc:
            if new:
                self.credentials.remove(name)
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "uri"
            raise InvalidInput(field, err["msg"]) from None
        try:
            info = await fleet.add_host(spec)
        except BaseException:
            if new:
                self.credentials.remove(name)
            raise
        stored: dict[str, object] = dict(labels)
        if extra:
            stored[SPEC_LABEL] = extra
        if kept:
            stored[CREDENTIALS_LABEL] = kept
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
        self.credentials.remove(name)
        async with self._svc.db.session() as s:
            row = await s.get(m.Host, name)
            if row is not None:
                await s.delete(row)
        self._svc.audit.record(who.actor, "host.remove", "host", name)
