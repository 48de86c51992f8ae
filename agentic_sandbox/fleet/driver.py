"""The driver protocol: what the fleet needs from one hypervisor host.

A host is a `HostDriver` instance: the fleet's parts (lifecycle, snapshots, clones, warm pool,
reconciliation) speak only these protocols and never a hypervisor's API. Today's only driver is
libvirt's (`fleet.libvirt.LibvirtHost`, for ``qemu:///system``, remote ``qemu+tcp/tls/ssh://``
URIs and the ``test:///`` driver of the fast test tier alike); hosts across a network are more
instances of it, not another backend.

Every method that talks to the hypervisor is a coroutine: a driver runs its blocking calls off
the event loop (libvirt's in the fleet's bounded executor) and raises only `FleetError`
subclasses (`NotFound`, `HostUnavailable`, `InvalidRequest`, `LibvirtFailure`, …).

A *definition* is the driver's own description of a domain (for libvirt, domain XML). The fleet
treats it as opaque text: it gets one from `HostDriver.render` (a new instance), from
`Domain.definition` (a snapshot clone's source) or from a saved image (a state clone's source),
gives it a new identity with `HostDriver.reidentify`, reads facts from it with
`HostDriver.describe`, and hands it back to `HostDriver.define`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from .domain_config import CloneIdentity, DomainConfig
from .errors import HostUnavailable
from .kvm_probe import AccelReport
from .models import HostSpec, InstanceRecord, InstanceState, SnapshotInfo
from .ports import PortAllocator

ByteProgress = Callable[[int, int], None]
"""Hears (bytes done, bytes in all) as a file goes to a host: a few dozen times per file."""


class PowerState(StrEnum):
    """What a hypervisor says a domain is doing (libvirt's ``virDomainState``)."""

    NO_STATE = "nostate"
    RUNNING = "running"
    BLOCKED = "blocked"
    PAUSED = "paused"
    SHUTTING_DOWN = "shutting-down"
    SHUTOFF = "shutoff"
    CRASHED = "crashed"
    PM_SUSPENDED = "pmsuspended"


_INSTANCE_STATE = {
    PowerState.NO_STATE: InstanceState.UNKNOWN,
    PowerState.RUNNING: InstanceState.RUNNING,
    PowerState.BLOCKED: InstanceState.RUNNING,
    PowerState.PAUSED: InstanceState.PAUSED,
    PowerState.SHUTTING_DOWN: InstanceState.RUNNING,  # shutting down, still running
    PowerState.SHUTOFF: InstanceState.SHUTOFF,
    PowerState.CRASHED: InstanceState.CRASHED,
    PowerState.PM_SUSPENDED: InstanceState.PAUSED,
}


@dataclass(frozen=True)
class DomainStatus:
    power: PowerState
    failed: bool = False  # shut off because the guest crashed or QEMU died

    @property
    def state(self) -> InstanceState:
        if self.power is PowerState.SHUTOFF and self.failed:
            return InstanceState.CRASHED
        return _INSTANCE_STATE.get(self.power, InstanceState.UNKNOWN)


class DomainEventKind(StrEnum):
    DEFINED = "defined"
    UNDEFINED = "undefined"
    CHANGED = "changed"  # started, stopped, paused, resumed, crashed, …


@dataclass(frozen=True)
class DomainEvent:
    """A lifecycle event of one domain on a host, in the fleet's terms."""

    domain: str
    uuid: str
    kind: DomainEventKind
    state: InstanceState | None = None  # None: the event does not change the state
    crashed: bool = False  # the guest crashed or QEMU died (restart policy applies)
    why: str = ""


@dataclass(frozen=True)
class DomainScan:
    """One domain as a host lists it (reconciliation)."""

    name: str
    uuid: str
    status: DomainStatus
    definition: str


@dataclass(frozen=True)
class DefinitionFacts:
    """What the fleet reads back from a definition (its own, or one inside a saved image)."""

    name: str
    uuid: str
    overlay: str | None
    vcpus: int
    memory_mib: int
    record: InstanceRecord | None  # the fleet's record in it; None for a foreign domain


class SavedImage(Protocol):
    """A memory image's header as the driver read it (`Volumes.read_saved`)."""

    @property
    def definition(self) -> str: ...


class HostListener(Protocol):
    """What a host tells the fleet, on the event loop's thread."""

    def on_domain_event(self, host: HostDriver, event: DomainEvent) -> None: ...

    def on_disconnect(self, host: HostDriver, why: str) -> None: ...

    async def on_reconnect(self, host: HostDriver) -> None: ...


class Domain(Protocol):
    """One domain on a host, found by `HostDriver.lookup` or made by `HostDriver.define`."""

    @property
    def name(self) -> str: ...

    async def uuid(self) -> str: ...

    async def is_active(self) -> bool: ...

    async def status(self) -> DomainStatus: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None:
        """Ask the guest to power off (ACPI); returns at once."""

    async def destroy(self) -> None:
        """Power off at once."""

    async def reboot(self) -> None:
        """Ask the guest to reboot (ACPI)."""

    async def reset(self) -> None:
        """Reset the machine at once."""

    async def suspend(self) -> None: ...

    async def resume(self) -> None: ...

    async def remove(self) -> None:
        """Destroy (if running) and undefine with everything the host keeps for it
        (managed save, snapshot metadata, NVRAM); gone already is fine."""

    async def definition(self, *, inactive: bool = False, secure: bool = False) -> str:
        """The domain's definition; ``inactive``: the persistent one (not the running
        one); ``secure``: with secrets (passwords) in it."""

    async def set_record(self, record: InstanceRecord) -> None:
        """Write the fleet's record into the domain (live and persistent)."""

    async def change_media(self, seed: str | None) -> None:
        """Put ``seed`` (a path on the host) in the seed drive, or eject it; a running guest
        sees a media change."""

    async def save(self, path: str) -> None:
        """Save the memory to ``path`` on the host; the domain stops."""

    async def restore(
        self, path: str, *, paused: bool | None, definition: str | None = None
    ) -> None:
        """Restore the saved memory image at ``path`` (whose header names this domain) into
        it, running or ``paused`` (None: as it was saved); ``definition`` replaces the
        header's where the backend takes one (a resumed source keeps its own disk)."""

    async def create_snapshot(
        self, instance_id: str, name: str, description: str, with_memory: bool
    ) -> SnapshotInfo:
        """An internal snapshot; an existing one of that name is returned as it is."""

    async def has_snapshot(self, name: str) -> bool: ...

    async def list_snapshots(self, instance_id: str) -> list[SnapshotInfo]: ...

    async def revert_snapshot(self, name: str, *, paused: bool) -> DomainStatus:
        """Revert; `NotFound` when there is no such snapshot. Returns the status after."""

    async def delete_snapshot(self, name: str) -> bool:
        """False when there was no such snapshot."""


class Volumes(Protocol):
    """A host's files: base images, instance files, saved states (three stores, named by
    kind: ``bases``, ``instances``, ``states``). Paths are paths on the host."""

    def path(self, kind: str, name: str) -> str: ...

    def holds(self, kind: str, path: str) -> bool:
        """Whether ``path`` lies in this host's store ``kind`` (a fleet's own data dir)."""

    async def exists(self, path: str) -> bool: ...

    async def image_path(self, name: str) -> str:
        """The path of base image ``name``; `NotFound` when the host does not have it."""

    async def create_overlay(
        self, kind: str, name: str, backing: str, capacity: int | None
    ) -> str: ...

    async def clone_snapshot_disk(self, src: str, snapshot: str, base: str, dest: str) -> None:
        """``dest`` = an overlay on ``base`` holding ``src``'s disk at internal ``snapshot``."""

    async def put_file(self, kind: str, name: str, source: str, *, mode: int = 0o600) -> str:
        """Upload a file of this machine into a store; returns its path on the host."""

    async def verified_digest(self, kind: str, name: str) -> str | None:
        """The SHA-256 recorded when ``name`` was put and read back; None if never."""

    async def mark_verified(self, kind: str, name: str, sha256: str) -> None:
        """Record that ``name`` reads back as ``sha256``."""

    async def digest(self, path: str) -> str:
        """The SHA-256 of a file as the host has it (read back over a stream if remote)."""

    async def put_verified(
        self,
        kind: str,
        name: str,
        source: str,
        sha256: str,
        *,
        mode: int = 0o600,
        progress: ByteProgress | None = None,
    ) -> str:
        """`put_file`, read back and checked against ``sha256`` before it counts as there;
        ``progress`` (called on the event loop) hears the bytes as they go."""

    async def copy(self, src: str, kind: str, name: str) -> str: ...

    async def read_range(self, path: str, offset: int, length: int | None) -> bytes:
        """Download part of a file (serial logs, save headers); `NotFound` when missing."""

    async def delete(self, path: str | None) -> bool: ...

    async def list_names(self, kind: str) -> list[str]: ...

    async def remove_instance_files(self, record: InstanceRecord) -> list[str]:
        """An instance's overlay, seeds and serial logs (and rotated copies)."""

    async def sweep_orphans(self, keep: Collection[str], busy_states: Collection[str]) -> list[str]:
        """Remove files of fleet domains not in ``keep`` and frozen disks nothing uses."""

    async def collect_frozen_disks(self, busy_states: Collection[str]) -> list[str]:
        """Remove frozen disks of deleted states that nothing on the host is backed by."""

    async def read_saved(self, path: str) -> SavedImage: ...

    async def write_saved(self, path: str, image: SavedImage, definition: str) -> None:
        """Rewrite the definition inside a saved memory image, in place."""

    async def forget(self) -> None:
        """Drop the host's stores (their files stay)."""


class HostDriver(Protocol):
    """One hypervisor host: its connection (kept and re-made), capacity, domains, files."""

    @property
    def name(self) -> str: ...

    @property
    def spec(self) -> HostSpec: ...

    @property
    def reachable(self) -> bool: ...

    @property
    def reason(self) -> str:
        """Why the host is unreachable ("" when it is reachable)."""

    @property
    def accel(self) -> AccelReport | None: ...

    @property
    def domain_type(self) -> str:
        """What new domains are made as (``qemu``: TCG, ``kvm``, ``test``)."""

    @property
    def virtual(self) -> bool:
        """A test backend: domains and volumes are not real (no guest runs)."""

    @property
    def files_local(self) -> bool:
        """The host's paths are this machine's paths."""

    @property
    def cpus(self) -> int: ...

    @property
    def memory_mib(self) -> int: ...

    @property
    def connect_count(self) -> int: ...

    @property
    def ports(self) -> PortAllocator:
        """The host's SSH forward ports (on its loopback)."""

    @property
    def volumes(self) -> Volumes: ...

    async def connect(self) -> None:
        """Connect now; `HostUnavailable` when the host cannot be reached."""

    def start_reconnecting(self) -> None:
        """Keep trying in the background (the listener hears ``on_reconnect``)."""

    async def close(self) -> None: ...

    async def free_memory_mib(self) -> int: ...

    async def list_domains(self) -> list[DomainScan]: ...

    async def domain_exists(self, name: str) -> bool: ...

    async def lookup(self, name: str, uuid: str = "") -> Domain:
        """By UUID when given and known, else by name; `NotFound` when neither is."""

    async def remove_domain(self, name: str, uuid: str = "") -> bool:
        """`Domain.remove` of the domain found as `lookup` would; False when there is none."""

    def render(self, cfg: DomainConfig) -> str:
        """A new domain's definition."""

    def reidentify(self, definition: str, ident: CloneIdentity) -> str:
        """The definition under a new name, UUID, disk, seed, serial log, forwards and
        record; the guest-visible machine is kept (a saved memory state still fits)."""

    def describe(self, definition: str) -> DefinitionFacts: ...

    async def define(self, definition: str) -> Domain:
        """Define (persistently) a domain; an existing one of that name is replaced."""


def require_reachable(host: HostDriver) -> None:
    """Refuse an operation that needs ``host`` now (`HostUnavailable`, naming why)."""
    if not host.reachable:
        raise HostUnavailable(f"host {host.name} is unreachable: {host.reason}")
