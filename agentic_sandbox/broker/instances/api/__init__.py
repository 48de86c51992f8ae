"""The admin routes over the fleet, one module per resource: thin adapters that parse the
request, call the service (`app[keys.…]`) and answer; errors become problems in `problems.py`."""

from aiohttp import web

from agentic_sandbox.broker.instances.api import (
    hosts,
    images,
    instances,
    loadouts,
    operations,
    pools,
    snapshots,
)

RESOURCES = (instances, snapshots, operations, hosts, images, loadouts, pools)


def install(app: web.Application) -> None:
    for resource in RESOURCES:
        resource.api.install(app)
