"""Admin routes for snapshots of an instance and clones made from them."""

from __future__ import annotations

import datetime as dt

from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.instances.api.models import (
    InstanceOut,
    JsonObject,
    OperationOut,
    SnapshotName,
    SshKey,
    instance_out,
)
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import INSTANCES, SNAPSHOTS

api = FleetRoutes()


class SnapshotCreate(Input):
    name: SnapshotName
    memory: bool = Field(
        default=True,
        description="with memory (the instance keeps running; clones restore it) or disk-only "
        "(the instance must be shut off)",
    )
    description: str = Field(default="", max_length=500)


class SnapshotOut(Output):
    id: str
    instance_id: str
    name: str
    kind: str
    state: str
    created_at: dt.datetime
    detail: JsonObject


class SnapshotList(Output):
    items: list[SnapshotOut]


class CloneBody(Input):
    new_id: InstanceId
    snapshot: SnapshotName
    ssh_keys: list[SshKey] = Field(default_factory=list, max_length=32)
    wait_ready: bool = True


@api.post(
    "/api/v2/admin/instances/{instance_id}/snapshots",
    body=SnapshotCreate,
    response=SnapshotOut,
    status=201,
    role=Role.operator,
    summary="Snapshot an instance (with memory: revertable and clonable)",
    tag="snapshots",
    responses={409: "a snapshot with that name exists"},
)
async def create_snapshot(call: Call[SnapshotCreate, NoQuery]) -> SnapshotOut:
    b = call.body
    snap = await call.app[SNAPSHOTS].create(
        call.require_principal(),
        call.match["instance_id"],
        name=b.name,
        memory=b.memory,
        description=b.description,
    )
    return SnapshotOut.model_validate(snap)


@api.get(
    "/api/v2/admin/instances/{instance_id}/snapshots",
    response=SnapshotList,
    role=Role.viewer,
    summary="List an instance's snapshots",
    tag="snapshots",
)
async def list_snapshots(call: Call[NoBody, NoQuery]) -> SnapshotList:
    snaps = await call.app[SNAPSHOTS].of_instance(
        call.require_principal(), call.match["instance_id"]
    )
    return SnapshotList(items=[SnapshotOut.model_validate(r) for r in snaps])


@api.post(
    "/api/v2/admin/instances/{instance_id}/snapshots/{name}/revert",
    response=InstanceOut,
    role=Role.operator,
    summary="Revert an instance to a snapshot",
    tag="snapshots",
)
async def revert_snapshot(call: Call[NoBody, NoQuery]) -> InstanceOut:
    row = await call.app[SNAPSHOTS].revert(
        call.require_principal(), call.match["instance_id"], call.match["name"]
    )
    return instance_out(row)


@api.delete(
    "/api/v2/admin/instances/{instance_id}/snapshots/{name}",
    role=Role.operator,
    summary="Delete a snapshot (clones made from it keep running; its frozen disk goes with "
    "the last of them)",
    tag="snapshots",
)
async def delete_snapshot(call: Call[NoBody, NoQuery]) -> None:
    await call.app[SNAPSHOTS].delete(
        call.require_principal(), call.match["instance_id"], call.match["name"]
    )


@api.post(
    "/api/v2/admin/instances/{instance_id}/clone",
    body=CloneBody,
    response=OperationOut,
    status=202,
    role=Role.operator,
    summary="Create a new instance from one of this instance's memory snapshots",
    tag="snapshots",
)
async def clone_instance(call: Call[CloneBody, NoQuery]) -> OperationOut:
    b = call.body
    op = await call.app[INSTANCES].clone(
        call.require_principal(),
        call.match["instance_id"],
        new_id=b.new_id,
        snapshot=b.snapshot,
        ssh_keys=tuple(b.ssh_keys),
        wait_ready=b.wait_ready,
    )
    return OperationOut.model_validate(op)
