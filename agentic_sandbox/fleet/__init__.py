"""fleet: libvirt VM fleet — hosts, instances, disks, snapshots, clones, warm pool, events.

The only package that touches libvirt (all of it under `fleet/libvirt/`, behind the driver
protocol of `fleet/driver.py`). Import from here; the modules are private.
"""

from .context import observe_stages
from .driver import Domain, HostDriver, Volumes
from .errors import (
    Conflict,
    FleetError,
    HostUnavailable,
    InvalidRequest,
    LibvirtFailure,
    NoCapacity,
    NotFound,
)
from .host_uri import HostUri, HostUriError, missing_tls_files, parse_host_uri
from .kvm_probe import AccelReport, probe_kvm
from .libvirt import METADATA_NS, LibvirtHost, preview_domain_xml
from .models import (
    AGENT_LINK_ADDRESS,
    DOMAIN_PREFIX,
    INSTANCE_ID_PATTERN,
    Accel,
    Capacity,
    CloneSpec,
    EgressPolicy,
    FirmwareBoot,
    FleetConfig,
    FleetEvent,
    FleetEventKind,
    HostInfo,
    HostSpec,
    Instance,
    InstanceRecord,
    InstanceSpec,
    InstanceState,
    IoTune,
    KernelBoot,
    ReconcileReport,
    Resources,
    SavedState,
    SnapshotInfo,
    validate_instance_id,
)
from .qemu_access import guard_dir, qemu_gid, traversal_problem
from .service import Fleet
from .warm_pool import PoolStatus, Standby

__all__ = [
    "AGENT_LINK_ADDRESS",
    "DOMAIN_PREFIX",
    "INSTANCE_ID_PATTERN",
    "METADATA_NS",
    "Accel",
    "AccelReport",
    "Capacity",
    "CloneSpec",
    "Conflict",
    "Domain",
    "EgressPolicy",
    "FirmwareBoot",
    "Fleet",
    "FleetConfig",
    "FleetError",
    "FleetEvent",
    "FleetEventKind",
    "HostDriver",
    "HostInfo",
    "HostSpec",
    "HostUnavailable",
    "HostUri",
    "HostUriError",
    "Instance",
    "InstanceRecord",
    "InstanceSpec",
    "InstanceState",
    "InvalidRequest",
    "IoTune",
    "KernelBoot",
    "LibvirtFailure",
    "LibvirtHost",
    "NoCapacity",
    "NotFound",
    "PoolStatus",
    "ReconcileReport",
    "Resources",
    "SavedState",
    "SnapshotInfo",
    "Standby",
    "Volumes",
    "guard_dir",
    "missing_tls_files",
    "observe_stages",
    "parse_host_uri",
    "preview_domain_xml",
    "probe_kvm",
    "qemu_gid",
    "traversal_problem",
    "validate_instance_id",
]
