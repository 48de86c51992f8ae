"""Provisioning: loadouts, cloud-init seeds and the pipeline that turns a name + loadout into a
running VM whose agent has enrolled. May use `fleet` and `images`; never `broker`."""

from provision.cloudinit import agent_bundle
from provision.loadouts import Loadout, LoadoutCatalog, LoadoutError, load_catalog
from provision.pipeline import (
    STAGES,
    Enroller,
    EnrollmentGrant,
    Provisioner,
    ProvisionError,
    ProvisionRequest,
    ProvisionResult,
    StageRecord,
)
from provision.seed import SeedFiles, read_seed_iso, write_seed_iso

__all__ = [
    "STAGES",
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
    "agent_bundle",
    "load_catalog",
    "read_seed_iso",
    "write_seed_iso",
]
