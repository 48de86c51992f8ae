"""Where the fleet's services live in the aiohttp application (the admin routes read them)."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.instances.hosts import HostService
from agentic_sandbox.broker.instances.images import ImageCatalog
from agentic_sandbox.broker.instances.loadouts import Loadouts
from agentic_sandbox.broker.instances.operations import Operations
from agentic_sandbox.broker.instances.pools import WarmPools
from agentic_sandbox.broker.instances.service import InstanceService
from agentic_sandbox.broker.instances.snapshots import SnapshotService

INSTANCES = web.AppKey("fleet_instances", InstanceService)
SNAPSHOTS = web.AppKey("fleet_snapshots", SnapshotService)
HOSTS = web.AppKey("fleet_hosts", HostService)
IMAGES = web.AppKey("fleet_images", ImageCatalog)
LOADOUTS = web.AppKey("fleet_loadouts", Loadouts)
POOLS = web.AppKey("fleet_pools", WarmPools)
OPERATIONS = web.AppKey("fleet_operations", Operations)
