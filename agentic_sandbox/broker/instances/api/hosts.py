"""Admin routes for hypervisor hosts."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.instances.api.models import HostName
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import HOSTS, POOLS
from agentic_sandbox.fleet import HostInfo

api = FleetRoutes()
LOOPBACK = "127.0.0.1"  # the fleet's control_address (`FleetConfig`) as the server builds it


class HostCreate(Input):
    name: HostName
    uri: str = Field(min_length=3, max_length=512, pattern=r"^(qemu|test)(\+[a-z]+)?://")
    labels: dict[Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")], str] = (
        Field(default_factory=dict, max_length=32)
    )
    capacity_vcpus: int | None = Field(default=None, ge=1)
    capacity_memory_mib: int | None = Field(default=None, ge=256)
    ssh_port_range: tuple[int, int] | None = None
    control_address: str | None = Field(
        default=None,
        max_length=45,
        description="where this host's guests reach this server (an IP literal the guest "
        "link gateway listens on: guest_link_listen or guest_link_addresses); default: "
        "127.0.0.1, for a host on this machine",
    )
    accel: Literal["auto", "kvm", "tcg"] = Field(
        default="auto",
        description="auto probes KVM on the host; name tcg for a host without a usable KVM",
    )
    data_dir: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^/",
        description="where the host keeps bases, instances and states (an absolute path on "
        "the host); default: this server's fleet directory",
    )
    files: Literal["auto", "local", "remote"] = Field(
        default="auto",
        description="remote: the host's files only through libvirt storage streams; auto: "
        "local when the URI names no remote host",
    )
    tls_pki_dir: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^/",
        description="qemu+tls: a directory on this server with the operator's cacert.pem, "
        "clientcert.pem and clientkey.pem; default: a client certificate from this server's "
        "CA (give the libvirtd its server certificate with POST "
        "/api/v2/admin/hosts/libvirtd-certificate)",
    )
    ssh_key_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="qemu+ssh (required): the name of your vault secret holding the private "
        "key (OpenSSH or PEM, unencrypted)",
    )
    ssh_known_hosts: str | None = Field(
        default=None,
        max_length=65536,
        description="qemu+ssh: the host's known_hosts entries; none: the key the host shows on "
        "the first connection is recorded and checked from then on",
    )

    @field_validator("control_address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            addr = ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("must be an IP address (IPv4 or IPv6 literal)") from None
        if addr.is_unspecified or addr.is_multicast:
            raise ValueError("must be one address guests can connect to")
        return str(addr)

    @field_validator("ssh_port_range")
    @classmethod
    def _range(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1024 <= value[0] <= value[1] <= 65535:
            raise ValueError("must be [low, high] within 1024..65535")
        return value


class HostOut(Output):
    name: str
    uri: str
    labels: dict[str, str]
    control_address: str = Field(description="where this host's guests reach this server")
    files: str
    state: str
    reason: str
    accel: str | None
    cpus: int
    memory_mib: int
    free_memory_mib: int
    committed_vcpus: int
    committed_memory_mib: int
    instances: int
    draining: bool = Field(description="takes no new placements (POST …/drain)")


class PoolMoveOut(Output):
    key: str
    state: Literal["moving", "stuck"] = Field(
        description="moving: a pool-move operation makes its members on another host first; "
        "stuck: no other host can take it (reason), its members stay"
    )
    operation_id: str | None
    reason: str


class HostDrainOut(HostOut):
    pools: list[PoolMoveOut] = Field(
        default_factory=list, description="the warm pools on this host and what the drain does"
    )


class HostList(Output):
    items: list[HostOut]


class HostRemoveQuery(Input):
    force: bool = False


def host_out(info: HostInfo) -> HostOut:
    return HostOut(
        name=info.spec.name,
        uri=info.spec.uri,
        labels=dict(info.spec.labels),
        control_address=info.spec.control_address or LOOPBACK,
        files=info.spec.files,
        state="reachable" if info.reachable else "unreachable",
        reason=info.reason,
        accel=info.accel.value if info.accel is not None else None,
        cpus=info.cpus,
        memory_mib=info.memory_mib,
        free_memory_mib=info.free_memory_mib,
        committed_vcpus=info.committed_vcpus,
        committed_memory_mib=info.committed_memory_mib,
        instances=info.instances,
        draining=info.draining,
    )


@api.get(
    "/api/v2/admin/hosts",
    response=HostList,
    role=Role.viewer,
    summary="Hypervisor hosts with capacity and reachability",
    tag="hosts",
)
async def list_hosts(call: Call[NoBody, NoQuery]) -> HostList:
    return HostList(items=[host_out(h) for h in await call.app[HOSTS].list_hosts()])


@api.post(
    "/api/v2/admin/hosts",
    body=HostCreate,
    response=HostOut,
    status=201,
    role=Role.admin,
    summary="Add a host by libvirt URI (kept and retried if unreachable now)",
    tag="hosts",
)
async def add_host(call: Call[HostCreate, NoQuery]) -> HostOut:
    b = call.body
    info = await call.app[HOSTS].add(
        call.require_principal(),
        name=b.name,
        uri=b.uri,
        labels=dict(b.labels),
        capacity_vcpus=b.capacity_vcpus,
        capacity_memory_mib=b.capacity_memory_mib,
        ssh_port_range=b.ssh_port_range,
        control_address=b.control_address,
        accel=b.accel,
        data_dir=b.data_dir,
        files=b.files,
        tls_pki_dir=b.tls_pki_dir,
        ssh_key_secret=b.ssh_key_secret,
        ssh_known_hosts=b.ssh_known_hosts,
    )
    return host_out(info)


class LibvirtdCertificateRequest(Input):
    csr_pem: str = Field(
        min_length=64,
        max_length=16384,
        description="a PEM certificate request made on the libvirtd host (its key stays there)",
    )
    names: list[
        Annotated[
            str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:-]+$")
        ]
    ] = Field(
        min_length=1,
        max_length=16,
        description="the addresses or DNS names this server's qemu+tls:// URIs use for it",
    )


class LibvirtdCertificate(Output):
    cacert_pem: str = Field(description="this server's CA: the libvirtd's cacert.pem")
    servercert_pem: str = Field(description="the libvirtd's servercert.pem")


@api.post(
    "/api/v2/admin/hosts/libvirtd-certificate",
    body=LibvirtdCertificateRequest,
    response=LibvirtdCertificate,
    role=Role.admin,
    summary="Sign a libvirtd's TLS server certificate with this server's CA (qemu+tls hosts)",
    tag="hosts",
)
async def libvirtd_certificate(
    call: Call[LibvirtdCertificateRequest, NoQuery],
) -> LibvirtdCertificate:
    cacert, cert = call.app[HOSTS].libvirtd_certificate(
        call.require_principal(), call.body.csr_pem, list(call.body.names)
    )
    return LibvirtdCertificate(cacert_pem=cacert, servercert_pem=cert)


@api.get(
    "/api/v2/admin/hosts/{name}",
    response=HostOut,
    role=Role.viewer,
    summary="One host",
    tag="hosts",
)
async def get_host(call: Call[NoBody, NoQuery]) -> HostOut:
    return host_out(await call.app[HOSTS].host_info(call.match["name"]))


@api.delete(
    "/api/v2/admin/hosts/{name}",
    query=HostRemoveQuery,
    role=Role.admin,
    summary="Remove a host (refused while it has instances, unless force)",
    tag="hosts",
)
async def remove_host(call: Call[NoBody, HostRemoveQuery]) -> None:
    await call.app[HOSTS].remove(
        call.require_principal(), call.match["name"], force=call.query.force
    )


@api.post(
    "/api/v2/admin/hosts/{name}/drain",
    response=HostDrainOut,
    role=Role.admin,
    summary="Drain a host: no new placements there (what runs there keeps running); its warm "
    "pools move to other hosts",
    tag="hosts",
)
async def drain_host(call: Call[NoBody, NoQuery]) -> HostDrainOut:
    who = call.require_principal()
    name = call.match["name"]
    info = await call.app[HOSTS].set_draining(who, name, True)
    moves = await call.app[POOLS].move_off(who, name)
    return HostDrainOut(
        **host_out(info).model_dump(),
        pools=[
            PoolMoveOut(key=p.key, state=p.state, operation_id=p.operation_id, reason=p.reason)
            for p in moves
        ],
    )


@api.delete(
    "/api/v2/admin/hosts/{name}/drain",
    response=HostOut,
    role=Role.admin,
    summary="Undrain a host: it takes new placements again",
    tag="hosts",
)
async def undrain_host(call: Call[NoBody, NoQuery]) -> HostOut:
    hosts = call.app[HOSTS]
    return host_out(await hosts.set_draining(call.require_principal(), call.match["name"], False))
