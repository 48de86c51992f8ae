"""Admin routes for loadouts (resolved, with `extends` applied)."""

from __future__ import annotations

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Output
from agentic_sandbox.broker.instances.api.models import JsonObject
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import LOADOUTS
from agentic_sandbox.provision import Loadout

api = FleetRoutes()


class LoadoutOut(Output):
    name: str
    description: str
    network: str
    resources: dict[str, int]
    packages: list[str]
    skills: list[JsonObject]
    task_runner: JsonObject
    sudo: bool


class LoadoutList(Output):
    items: list[LoadoutOut]


def loadout_out(lo: Loadout) -> LoadoutOut:
    return LoadoutOut(
        name=lo.name,
        description=lo.description,
        network=lo.network,
        resources=lo.resources.model_dump(),
        packages=list(lo.packages),
        skills=[s.model_dump(exclude_none=True) for s in lo.skills],
        task_runner=lo.task_runner.model_dump(exclude_none=True),
        sudo=lo.sudo,
    )


@api.get(
    "/api/v2/admin/loadouts",
    response=LoadoutList,
    role=Role.viewer,
    summary="Loadouts (resolved, with `extends` applied)",
    tag="loadouts",
)
async def list_loadouts(call: Call[NoBody, NoQuery]) -> LoadoutList:
    loadouts = call.app[LOADOUTS]
    return LoadoutList(items=[loadout_out(loadouts.get(n)) for n in loadouts.names()])


@api.get(
    "/api/v2/admin/loadouts/{name}",
    response=LoadoutOut,
    role=Role.viewer,
    summary="One loadout",
    tag="loadouts",
)
async def get_loadout(call: Call[NoBody, NoQuery]) -> LoadoutOut:
    return loadout_out(call.app[LOADOUTS].get(call.match["name"]))
