"""Provisioning: loadouts, cloud-init seeds and the pipeline that turns a name + loadout into a
running VM whose agent has enrolled. May use `fleet` and `images`; never `broker`."""

from agentic_sandbox.provision.bundle import (
    AgentBundle,
    BundleError,
    build_bundle,
    bundle_digest,
    bundle_version,
    check_bundle,
)
from agentic_sandbox.provision.loadouts import (
    Budgets,
    Loadout,
    LoadoutCatalog,
    LoadoutError,
    extend,
    load_catalog,
)
from agentic_sandbox.provision.pipeline import (
    STAGES,
    Enroller,
    EnrollmentGrant,
    Provisioner,
    ProvisionError,
    ProvisionRequest,
    ProvisionResult,
    StageRecord,
    network_refusal,
)
from agentic_sandbox.provision.seed import SeedFiles, read_seed_iso, write_seed_iso

__all__ = [
    "STAGES",
    "AgentBundle",
    "Budgets",
    "BundleError",
    "Enroller",
    "EnrollmentGrant",
    "Loadout",
    "LoadoutCatalog",
    "LoadoutError",
    "ProvisionError",
    "ProvisionRequest",
    "ProvisionResult",
    "Provisioner",
    "SeedFiles",
    "StageRecord",
    "build_bundle",
    "bundle_digest",
    "bundle_version",
    "check_bundle",
    "extend",
    "load_catalog",
    "network_refusal",
    "read_seed_iso",
    "write_seed_iso",
]
