"""Typed models of the fleet: what callers pass in and what they get back.

Inputs (`*Spec`, `FleetConfig`) forbid unknown fields and validate names, ports and paths so no
malformed value reaches libvirt, the XML or a file name.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from .host_uri import HostUriError, check_credentials, connection_uri, parse_host_uri

INSTANCE_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
_INSTANCE_ID_RE = re.compile(INSTANCE_ID_PATTERN)
# Names of things the fleet turns into file or volume names (images, snapshots, states, hosts).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME_RE = re.compile(NAME_PATTERN)
DOMAIN_PREFIX = "sbx-"
AGENT_LINK_ADDRESS = "10.0.2.2"
"""Where a guest reaches the agent link (the server's gRPC port), under either egress policy."""
# The virtio-serial port with the same host side as the forward (the guest link gateway): in the
# guest, /dev/virtio-ports/<this>; its agent prefers it (agent/serial_link.py).
AGENT_LINK_PORT_NAME = "org.agentic-sandbox.link"


def validate_instance_id(value: str) -> str:
    if not isinstance(value, str) or not _INSTANCE_ID_RE.match(value):
        raise ValueError(f"invalid instance id {value!r}: must match {INSTANCE_ID_PATTERN}")
    return value


def validate_name(value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise ValueError(f"invalid name {value!r}: must match {NAME_PATTERN}")
    return value


def validate_control_address(value: str) -> str:
    """An IP literal a guest's forward can connect to (normalised; not unspecified/multicast)."""
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address (IPv4 or IPv6 literal)") from None
    if addr.is_unspecified or addr.is_multicast:
        raise ValueError(f"{value!r} cannot be connected to (unspecified or multicast)")
    return str(addr)


ControlAddress = Annotated[str, Field(max_length=45), AfterValidator(validate_control_address)]


def validate_abs_path(value: str) -> str:
    p = PurePosixPath(value)
    if not p.is_absolute() or ".." in p.parts or "\0" in value or "\n" in value:
        raise ValueError(f"invalid path {value!r}: must be absolute, without '..'")
    # QEMU's option syntax uses ',' as a separator; keep paths free of it.
    if "," in value:
        raise ValueError(f"invalid path {value!r}: ',' is not allowed")
    return str(p)


InstanceId = Annotated[str, AfterValidator(validate_instance_id)]
Name = Annotated[str, AfterValidator(validate_name)]
AbsPath = Annotated[str, AfterValidator(validate_abs_path)]
Port = Annotated[int, Field(ge=1, le=65535)]
Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")]


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceState(StrEnum):
    DEFINED = "defined"  # being made / defined, never started
    RUNNING = "running"
    PAUSED = "paused"
    SHUTOFF = "shutoff"
    CRASHED = "crashed"
    UNKNOWN = "unknown"  # its host is unreachable
    LOST = "lost"  # the fleet knew it, libvirt no longer has it


class EgressPolicy(StrEnum):
    ISOLATED = "isolated"  # only the agent link (and inbound SSH forward)
    # as isolated at the VM (restrict=on): tools reach the host's egress proxy over the link
    ALLOWLIST = "allowlist"
    NAT = "nat"  # ordinary user-mode NAT

    @property
    def restricted(self) -> bool:
        """QEMU drops everything but the explicit forwards (`restrict=on`)."""
        return self is not EgressPolicy.NAT


class Accel(StrEnum):
    KVM = "kvm"
    TCG = "tcg"


class KernelBoot(_Input):
    """Direct kernel boot. ``kernel``/``initrd`` name volumes in the host's image store
    (see `Fleet.import_image`)."""

    kind: Literal["kernel"] = "kernel"
    kernel: Name
    initrd: Name | None = None
    cmdline: str = Field(default="console=ttyS0", max_length=2048)

    @model_validator(mode="after")
    def _cmdline_printable(self) -> KernelBoot:
        if any(ord(c) < 32 for c in self.cmdline):
            raise ValueError("cmdline: control characters are not allowed")
        return self


class FirmwareBoot(_Input):
    kind: Literal["firmware"] = "firmware"
    firmware: Literal["bios", "efi"] = "bios"


class IoTune(_Input):
    """Block I/O limits of the instance's disk (0 = unlimited)."""

    total_bytes_sec: int = Field(default=0, ge=0)
    read_bytes_sec: int = Field(default=0, ge=0)
    write_bytes_sec: int = Field(default=0, ge=0)
    total_iops_sec: int = Field(default=0, ge=0)
    read_iops_sec: int = Field(default=0, ge=0)
    write_iops_sec: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _no_total_with_split(self) -> IoTune:
        if self.total_bytes_sec and (self.read_bytes_sec or self.write_bytes_sec):
            raise ValueError("iotune: total_bytes_sec excludes read/write_bytes_sec")
        if self.total_iops_sec and (self.read_iops_sec or self.write_iops_sec):
            raise ValueError("iotune: total_iops_sec excludes read/write_iops_sec")
        return self

    def is_empty(self) -> bool:
        return not any(self.model_dump().values())


class Resources(_Input):
    vcpus: int = Field(default=1, ge=1, le=64)
    memory_mib: int = Field(default=512, ge=64, le=1024 * 1024)
    disk_gib: int | None = Field(default=None, ge=1, le=16384, description="None: base size")
    cpu_shares: int | None = Field(default=None, ge=2, le=262144)
    cpu_quota_pct: int | None = Field(
        default=None, ge=1, le=6400, description="CPU cap in percent of one core"
    )
    iotune: IoTune = IoTune()
    tb_cache_mib: int | None = Field(
        default=64, ge=1, le=4096, description="TCG translation cache cap (TCG guests only)"
    )


class InstanceSpec(_Input):
    """Everything needed to create one instance."""

    instance_id: InstanceId
    owner: str = Field(default="", max_length=128)
    incarnation: str = Field(
        default="", max_length=36, description="the server's id of this create of the instance id"
    )
    image: Name = Field(description="base image volume name in the host's image store")
    loadout: str | None = Field(default=None, max_length=128)
    boot: KernelBoot | FirmwareBoot = FirmwareBoot()
    resources: Resources = Resources()
    egress: EgressPolicy = EgressPolicy.ISOLATED
    agent_port: Port = 8120
    seed: AbsPath | None = Field(
        default=None, description="local cloud-init seed ISO; copied to the host"
    )
    image_files: dict[Name, AbsPath] = Field(
        default_factory=dict,
        max_length=8,
        description="local files of the image (store name -> path: disk, kernel, initrd) that "
        "the chosen host gets, checked by SHA-256, when it lacks them",
    )
    host: Name | None = Field(default=None, description="pin to this host; None: placement")
    host_labels: dict[Label, str] = Field(default_factory=dict)
    anti_affinity: Name | None = None
    restart_on_crash: bool = True


class CloneSpec(_Input):
    """A new identity for a clone (from a snapshot or a saved state) or a warm-pool take."""

    instance_id: InstanceId
    owner: str = Field(default="", max_length=128)
    incarnation: str = Field(
        default="", max_length=36, description="the server's id of this create of the instance id"
    )
    loadout: str | None = Field(default=None, max_length=128)
    egress: EgressPolicy = EgressPolicy.ISOLATED
    agent_port: Port = 8120
    seed: AbsPath | None = None
    restart_on_crash: bool = True


class Capacity(_Input):
    vcpus: int | None = Field(default=None, ge=1, description="None: host CPUs x overcommit")
    memory_mib: int | None = Field(default=None, ge=64, description="None: host memory")
    reserved_memory_mib: int = Field(default=1024, ge=0)
    vcpu_overcommit: float = Field(default=4.0, gt=0)


class HostSpec(_Input):
    name: Name
    uri: str = Field(min_length=3, max_length=512)
    labels: dict[Label, str] = Field(default_factory=dict)
    capacity: Capacity = Capacity()
    data_dir: AbsPath | None = Field(
        default=None, description="where this host keeps bases/instances/states"
    )
    files: Literal["auto", "local", "remote"] = Field(
        default="auto",
        description="local: the host's files are this machine's files; remote: only through "
        "libvirt storage streams; auto: local when the URI names no remote host",
    )
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    ssh_port_range: tuple[Port, Port] = (42200, 42999)
    control_address: ControlAddress | None = Field(
        default=None,
        description="where this host's guests reach the control plane (the guest link "
        "gateway: agent link and enrollment); None: the fleet's `control_address`",
    )

    tls_pki_dir: AbsPath | None = Field(
        default=None,
        description="qemu+tls: the directory with cacert.pem, clientcert.pem and clientkey.pem "
        "(the URI's pkipath); None: libvirt's default",
    )
    ssh_key_file: AbsPath | None = Field(
        default=None, description="qemu+ssh: the private key file (0600) the connection uses"
    )
    ssh_known_hosts: AbsPath | None = Field(
        default=None,
        description="qemu+ssh: the host's known_hosts file; empty: trust on first use, "
        "recorded there and checked from then on",
    )

    @model_validator(mode="after")
    def _check(self) -> HostSpec:
        lo, hi = self.ssh_port_range
        if lo > hi:
            raise ValueError("ssh_port_range: low > high")
        try:
            check_credentials(
                parse_host_uri(self.uri),
                tls_pki_dir=self.tls_pki_dir,
                ssh_key_file=self.ssh_key_file,
                ssh_known_hosts=self.ssh_known_hosts,
            )
        except HostUriError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def connection_uri(self) -> str:
        """The URI the fleet opens: `uri` with the credential parameters added."""
        return connection_uri(
            self.uri,
            tls_pki_dir=self.tls_pki_dir,
            ssh_key_file=self.ssh_key_file,
            ssh_known_hosts=self.ssh_known_hosts,
        )

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        """A libvirt URI of libvirt's remote protocol only (`host_uri.parse_host_uri`)."""
        try:
            parse_host_uri(value)
        except HostUriError as exc:
            raise ValueError(str(exc)) from None
        return value


class FleetConfig(_Input):
    data_dir: AbsPath = "/var/lib/agentic-sandbox/fleet"
    executor_workers: int = Field(default=8, ge=1, le=64)
    shutdown_timeout_s: float = Field(default=30.0, gt=0)
    crash_loop_threshold: int = Field(default=3, ge=1)
    crash_loop_window_s: float = Field(default=300.0, gt=0)
    restart_delay_s: float = Field(default=1.0, ge=0)
    reconnect_initial_s: float = Field(default=0.2, gt=0)
    reconnect_max_s: float = Field(default=10.0, gt=0)
    keepalive_interval_s: int = Field(default=5, ge=0)
    keepalive_count: int = Field(default=3, ge=1)
    machine: Literal["pc", "q35"] = "pc"
    nic_pci_slot: int = Field(default=0x1F, ge=3, le=0x1F)
    kvm_probe_timeout_s: float = Field(default=8.0, gt=0)
    kvm_probe_kernel: AbsPath | None = None
    pool_memory_headroom_mib: int = Field(default=1024, ge=0)
    pool_warmup_s: float = Field(
        default=1.0,
        ge=0,
        description="run a new pool member this long before pausing it (warms TCG's "
        "translation cache so a hand-off is fast)",
    )
    pool_standby_wait_s: float = Field(
        default=20.0,
        ge=0,
        description="at most this long after the warm-up, wait for a standing-by pool member's "
        "console to say it is ready (its agent made its spare key) before pausing it",
    )
    pool_refill_delay_s: float = Field(
        default=2.0,
        ge=0,
        description="wait after a hand-off before refilling, so the refill "
        "does not compete with the guest that was just handed out",
    )
    default_uri: str = "qemu:///system"
    qemu_group: str | None = Field(
        default="libvirt-qemu",
        max_length=64,
        description="the group QEMU runs with: the fleet's folders are root:<it> 0710 (when "
        "the server runs as root), so no other local user reaches seeds, disks or states",
    )
    control_address: str = Field(
        default="127.0.0.1",
        max_length=253,
        pattern=r"^[A-Za-z0-9.:_-]+$",
        description="where guests' forwards lead on the control host: the guest link gateway "
        "(agent link and enrollment) listens there, at each instance's agent port",
    )


class CrashRecord(BaseModel):
    model_config = ConfigDict(frozen=True)
    at: datetime
    reason: str = ""


class InstanceRecord(BaseModel):
    """The fleet's facts about one instance, kept in the domain XML ``<metadata>``."""

    model_config = ConfigDict(extra="ignore")

    instance_id: InstanceId
    domain: str
    host: str
    owner: str = ""
    incarnation: str = ""  # the server's id of this create (recorded with the domain)
    image: str = ""
    loadout: str | None = None
    overlay: str = ""
    seed: str | None = None
    serial_log: str = ""
    ssh_port: int | None = None
    agent_port: int = 8120
    egress: EgressPolicy = EgressPolicy.ISOLATED
    vcpus: int = 1
    memory_mib: int = 512
    created_at: datetime = Field(default_factory=utcnow)
    origin: str | None = Field(default=None, description="state:<id> or snapshot:<inst>/<name>")
    pool: str | None = Field(default=None, description="warm-pool key while pooled")
    anti_affinity: str | None = None
    restart_on_crash: bool = True
    crashes: list[CrashRecord] = Field(default_factory=list)


class Instance(BaseModel):
    """What callers see: the record plus the current state."""

    model_config = ConfigDict(frozen=True)

    record: InstanceRecord
    state: InstanceState
    state_reason: str = ""

    @property
    def instance_id(self) -> str:
        return self.record.instance_id

    @property
    def host(self) -> str:
        return self.record.host


class SnapshotInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    instance_id: str
    name: str
    created_at: datetime
    with_memory: bool
    domain_state: str
    description: str = ""
    parent: str | None = None
    current: bool = False


class SavedState(BaseModel):
    """A saved memory state (+ its frozen disk) that new instances are restored from."""

    model_config = ConfigDict(frozen=True)
    state_id: str
    host: str
    save_path: str
    disk_path: str
    image: str
    loadout: str | None = None
    vcpus: int
    memory_mib: int
    created_at: datetime


class HostInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    spec: HostSpec
    reachable: bool
    reason: str = ""
    accel: Accel | None = None
    accel_reason: str = ""
    cpus: int = 0
    memory_mib: int = 0
    free_memory_mib: int = 0
    committed_vcpus: int = 0
    committed_memory_mib: int = 0
    instances: int = 0
    draining: bool = False


class FleetEventKind(StrEnum):
    INSTANCE_STATE_CHANGED = "instance.state_changed"
    INSTANCE_CREATED = "instance.created"
    INSTANCE_DELETED = "instance.deleted"
    INSTANCE_ADOPTED = "instance.adopted"
    INSTANCE_LOST = "instance.lost"
    INSTANCE_CRASHED = "instance.crashed"
    INSTANCE_CRASH_LOOP = "instance.crash_loop"
    SNAPSHOT_CREATED = "snapshot.created"
    SNAPSHOT_REVERTED = "snapshot.reverted"
    SNAPSHOT_DELETED = "snapshot.deleted"
    HOST_ADDED = "host.added"
    HOST_REMOVED = "host.removed"
    HOST_UNREACHABLE = "host.unreachable"
    HOST_RECONNECTED = "host.reconnected"
    HOST_DRAINING = "host.draining"
    IMAGE_UPLOADING = "image.uploading"
    IMAGE_VERIFIED = "image.verified"
    HOST_UNDRAINED = "host.undrained"
    ORPHAN_REMOVED = "fleet.orphan_removed"
    POOL_REFILLED = "pool.refilled"


class FleetEvent(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: FleetEventKind
    host: str | None = None
    instance_id: str | None = None
    # the incarnation of the instance the event is about (an id can be used again: a late
    # event of a deleted instance must not touch its successor)
    incarnation: str | None = None
    state: InstanceState | None = None
    detail: str = ""
    at: datetime = Field(default_factory=utcnow)


class ReconcileReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    host: str
    adopted: list[str] = Field(default_factory=list)
    lost: list[str] = Field(default_factory=list)
    orphans_removed: list[str] = Field(default_factory=list)
    foreign: list[str] = Field(default_factory=list)
    states_changed: list[str] = Field(default_factory=list)
