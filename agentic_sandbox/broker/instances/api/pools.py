"""Admin routes for warm pools: prepare (or resize), list, remove."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.instances.api.models import OperationOut
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import POOLS
from agentic_sandbox.broker.instances.pools import PoolView

api = FleetRoutes()


class PoolCreate(Input):
    image: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9_.-]{0,127}$")
    loadout: str = Field(default="minimal", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    loadout_version: int | None = Field(
        default=None, ge=1, description="a version of the loadout; default: its active one"
    )
    network: Literal["isolated", "allowlist", "nat"] | None = None
    size: int = Field(default=2, ge=0, le=64)


class PoolOut(Output):
    key: str
    image: str
    loadout: str
    loadout_version: int | None
    network: str
    size: int
    ready: int
    last_error: str


class PoolList(Output):
    items: list[PoolOut]


def pool_out(view: PoolView) -> PoolOut:
    rec = view.record
    return PoolOut(
        key=rec.key,
        image=rec.image,
        loadout=rec.loadout,
        loadout_version=rec.loadout_version,
        network=rec.network,
        size=rec.size,
        ready=view.ready,
        last_error=view.last_error,
    )


@api.post(
    "/api/v2/admin/pools",
    body=PoolCreate,
    response=OperationOut,
    status=202,
    role=Role.admin,
    summary="Prepare (or resize) a warm pool for an image + loadout version + network",
    tag="pools",
)
async def create_pool(call: Call[PoolCreate, NoQuery]) -> OperationOut:
    b = call.body
    op = await call.app[POOLS].prepare(
        call.require_principal(),
        image=b.image,
        loadout=b.loadout,
        loadout_version=b.loadout_version,
        network=b.network,
        size=b.size,
    )
    return OperationOut.model_validate(op)


@api.get(
    "/api/v2/admin/pools",
    response=PoolList,
    role=Role.viewer,
    summary="Warm pools and how many VMs each has ready",
    tag="pools",
)
async def list_pools(call: Call[NoBody, NoQuery]) -> PoolList:
    return PoolList(items=[pool_out(v) for v in await call.app[POOLS].views()])


@api.delete(
    "/api/v2/admin/pools/{key}",
    role=Role.admin,
    summary="Drain and remove a warm pool",
    tag="pools",
)
async def delete_pool(call: Call[NoBody, NoQuery]) -> None:
    await call.app[POOLS].remove(call.require_principal(), call.match["key"])
