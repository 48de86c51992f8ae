"""Admin routes for loadouts: the active versions (resolved, with `extends` applied), saving a
version, a name's versions, one version, and activating one (compare-and-set)."""

from __future__ import annotations

import datetime as dt

from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.instances.api.models import JsonObject
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.errors import NotFoundError
from agentic_sandbox.broker.instances.keys import LOADOUTS
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision import Loadout

api = FleetRoutes()

LoadoutName = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")


class LoadoutOut(Output):
    name: str
    version: int = Field(description="the active version")
    digest: str = Field(description="its SHA-256 (of the canonical JSON of what was saved)")
    owner: str
    shared: bool
    description: str
    network: str
    resources: dict[str, int]
    packages: list[str]
    skills: list[JsonObject]
    task_runner: JsonObject
    sudo: bool


class LoadoutList(Output):
    items: list[LoadoutOut]


class ExtendsOut(Output):
    name: str
    version: int


class LoadoutVersionOut(Output):
    name: str
    version: int
    digest: str
    active: bool
    extends: ExtendsOut | None = Field(description="the parent version `extends` resolved to")
    spec: JsonObject = Field(description="the spec as saved")
    resolved: JsonObject = Field(description="the loadout with `extends` applied")
    created_by: str
    created_at: dt.datetime


class LoadoutSaved(LoadoutVersionOut):
    created: bool = Field(description="false: identical content was saved before (201 vs 200)")


class LoadoutVersionList(Output):
    name: str
    owner: str
    shared: bool
    active_version: int
    items: list[LoadoutVersionOut]


class LoadoutSave(Input):
    name: str = LoadoutName
    spec: JsonObject = Field(description="the loadout as its YAML would be (`name` optional)")
    shared: bool = Field(
        default=False, description="admins only: everyone reads it (decided by a name's first save)"
    )


class LoadoutActivate(Input):
    version: int = Field(ge=1, description="the version to make active")
    expected_version: int = Field(
        ge=1, description="the version the caller saw active; 409 when it has moved"
    )


class LoadoutActivated(Output):
    name: str
    active_version: int
    previous_version: int


def loadout_out(head: m.Loadout, row: m.LoadoutVersion) -> LoadoutOut:
    lo = Loadout.model_validate(row.resolved)
    return LoadoutOut(
        name=lo.name,
        version=row.version,
        digest=row.digest,
        owner=head.owner,
        shared=head.shared,
        description=lo.description,
        network=lo.network,
        resources=lo.resources.model_dump(),
        packages=list(lo.packages),
        skills=[s.model_dump(exclude_none=True) for s in lo.skills],
        task_runner=lo.task_runner.model_dump(exclude_none=True),
        sudo=lo.sudo,
    )


def version_out(head: m.Loadout, row: m.LoadoutVersion) -> LoadoutVersionOut:
    spec = row.document.get("spec")
    return LoadoutVersionOut(
        name=row.name,
        version=row.version,
        digest=row.digest,
        active=row.version == head.active_version,
        extends=(
            ExtendsOut(name=row.extends_name, version=row.extends_version)
            if row.extends_name is not None and row.extends_version is not None
            else None
        ),
        spec=spec if isinstance(spec, dict) else {},
        resolved=row.resolved,
        created_by=row.created_by,
        created_at=row.created_at,
    )


@api.get(
    "/api/v2/admin/loadouts",
    response=LoadoutList,
    role=Role.viewer,
    summary="Loadouts: the active version of each (resolved, with `extends` applied)",
    tag="loadouts",
)
async def list_loadouts(call: Call[NoBody, NoQuery]) -> LoadoutList:
    heads = await call.app[LOADOUTS].heads(call.require_principal())
    return LoadoutList(items=[loadout_out(h, v) for h, v in heads])


@api.post(
    "/api/v2/admin/loadouts",
    body=LoadoutSave,
    response=LoadoutSaved,
    status=201,
    role=Role.operator,
    summary="Save a loadout version (201 new; 200 when identical content is saved already)",
    tag="loadouts",
    responses={200: "identical content: the version saved before"},
)
async def save_loadout(call: Call[LoadoutSave, NoQuery]) -> LoadoutSaved:
    b = call.body
    saved = await call.app[LOADOUTS].save(call.require_principal(), b.name, b.spec, shared=b.shared)
    call.status = 201 if saved.created else 200
    out = version_out(saved.head, saved.version)
    return LoadoutSaved(**out.model_dump(), created=saved.created)


@api.get(
    "/api/v2/admin/loadouts/{name}",
    response=LoadoutOut,
    role=Role.viewer,
    summary="One loadout (its active version)",
    tag="loadouts",
)
async def get_loadout(call: Call[NoBody, NoQuery]) -> LoadoutOut:
    head, row = await call.app[LOADOUTS].active(call.require_principal(), call.match["name"])
    return loadout_out(head, row)


@api.get(
    "/api/v2/admin/loadouts/{name}/versions",
    response=LoadoutVersionList,
    role=Role.viewer,
    summary="A loadout's versions, oldest first",
    tag="loadouts",
)
async def list_versions(call: Call[NoBody, NoQuery]) -> LoadoutVersionList:
    head, rows = await call.app[LOADOUTS].versions(call.require_principal(), call.match["name"])
    return LoadoutVersionList(
        name=head.name,
        owner=head.owner,
        shared=head.shared,
        active_version=head.active_version,
        items=[version_out(head, r) for r in rows],
    )


@api.get(
    "/api/v2/admin/loadouts/{name}/versions/{version}",
    response=LoadoutVersionOut,
    role=Role.viewer,
    summary="One version of a loadout",
    tag="loadouts",
)
async def get_version(call: Call[NoBody, NoQuery]) -> LoadoutVersionOut:
    name, raw = call.match["name"], call.match["version"]
    if not raw.isdigit() or len(raw) > 9:
        raise NotFoundError("loadout version", f"{name}@{raw}")
    loadouts = call.app[LOADOUTS]
    who = call.require_principal()
    row = await loadouts.version(who, name, int(raw))
    return version_out(await loadouts.head(who, name), row)


@api.post(
    "/api/v2/admin/loadouts/{name}/activate",
    body=LoadoutActivate,
    response=LoadoutActivated,
    role=Role.operator,
    summary="Make a version active, if the active one is still `expected_version` (else 409)",
    tag="loadouts",
    responses={409: "the active version has moved (`active_version` says to which)"},
)
async def activate_loadout(call: Call[LoadoutActivate, NoQuery]) -> LoadoutActivated:
    b = call.body
    head = await call.app[LOADOUTS].activate(
        call.require_principal(), call.match["name"], b.version, b.expected_version
    )
    return LoadoutActivated(
        name=head.name, active_version=head.active_version, previous_version=b.expected_version
    )
