"""Admin routes for instances: create, list, get, the lifecycle actions, delete, console."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.instances.api.models import (
    HostName,
    InstanceOut,
    JsonObject,
    OperationOut,
    SshKey,
    instance_out,
)
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import INSTANCES
from agentic_sandbox.broker.instances.service import Action, InstanceFilter, NewInstance
from agentic_sandbox.provision.egress_rules import EgressConfig

api = FleetRoutes()


class ResourcesIn(Input):
    cpus: int | None = Field(default=None, ge=1, le=64)
    memory_mib: int | None = Field(default=None, ge=256, le=262144)
    disk_gib: int | None = Field(default=None, ge=2, le=4096)


class InstanceCreate(Input):
    id: InstanceId
    image: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9_.-]{0,127}$",
        description="image name, or a recipe name (its cached build is used); default recipe",
    )
    loadout: str = Field(default="minimal", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    loadout_version: int | None = Field(
        default=None, ge=1, description="a version of `loadout`; default: its active one"
    )
    from_snapshot: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}/[a-z0-9][a-z0-9_.-]{0,62}$",
        description="INSTANCE/SNAPSHOT: restore a memory snapshot under this new identity",
    )
    from_pool: bool | None = Field(
        default=None,
        description="true: take a restored VM from the matching warm pool (image, loadout "
        "version, network); false: boot from the image; unset: the matching pool when there "
        "is one and nothing asked for differs from its members (resources, host, labels, an "
        "inline loadout, start), else the image. The operation's result names the `source`",
    )
    resources: ResourcesIn = ResourcesIn()
    network: Literal["isolated", "allowlist", "nat"] | None = None
    egress: EgressConfig | None = Field(
        default=None,
        description="the allowlist and limits (`allowlist`); unset: the loadout's",
    )
    ssh_keys: list[SshKey] = Field(default_factory=list, max_length=32)
    host: HostName | None = None
    host_labels: dict[Annotated[str, StringConstraints(max_length=63)], str] = Field(
        default_factory=dict, max_length=16
    )
    wait_ready: bool = Field(default=True, description="the operation ends when the agent enrolls")
    start: bool = Field(default=True, description="start it (false: define only)")
    ready_timeout_seconds: float | None = Field(
        default=None,
        ge=1,
        le=3600,
        description="how long to wait for the agent, exactly (default: the server's, "
        "which waits on while the guest's console advances)",
    )
    loadout_spec: JsonObject | None = Field(
        default=None, description="an inline loadout (as its YAML would be) instead of `loadout`"
    )

    def new_instance(self) -> NewInstance:
        return NewInstance(
            id=self.id,
            image=self.image,
            loadout=self.loadout,
            loadout_version=self.loadout_version,
            loadout_spec=self.loadout_spec,
            from_snapshot=self.from_snapshot,
            from_pool=self.from_pool,
            cpus=self.resources.cpus,
            memory_mib=self.resources.memory_mib,
            disk_gib=self.resources.disk_gib,
            network=self.network,
            egress=self.egress,
            ssh_keys=tuple(self.ssh_keys),
            host=self.host,
            host_labels=dict(self.host_labels),
            wait_ready=self.wait_ready,
            start=self.start,
            ready_timeout_seconds=self.ready_timeout_seconds,
        )


class InstanceList(Output):
    items: list[InstanceOut]


class InstanceQuery(Input):
    state: str | None = Field(default=None, max_length=32)
    host: HostName | None = None
    owner: str | None = Field(default=None, max_length=128)
    limit: int = Field(default=500, ge=1, le=5000)


class ShutdownBody(Input):
    grace_seconds: float | None = Field(default=None, ge=0, le=3600)


class ConsoleQuery(Input):
    tail: int = Field(default=64 * 1024, ge=1, le=16 * 1024 * 1024, description="bytes")


class ConsoleOut(Output):
    instance_id: str
    size: int
    text: str


@api.post(
    "/api/v2/admin/instances",
    body=InstanceCreate,
    response=OperationOut,
    status=202,
    role=Role.operator,
    summary="Create an instance (cold from an image, from a memory snapshot, or from the pool)",
    tag="instances",
    responses={409: "the id is taken", 429: "instance quota reached"},
)
async def create_instance(call: Call[InstanceCreate, NoQuery]) -> OperationOut:
    instances = call.app[INSTANCES]
    op = await instances.create(call.require_principal(), call.body.new_instance())
    return OperationOut.model_validate(op)


@api.get(
    "/api/v2/admin/instances",
    query=InstanceQuery,
    response=InstanceList,
    role=Role.viewer,
    summary="List instances (yours, or all as admin)",
    tag="instances",
    follower=True,
)
async def list_instances(call: Call[NoBody, InstanceQuery]) -> InstanceList:
    q = call.query
    where = InstanceFilter(state=q.state, host=q.host, owner=q.owner, limit=q.limit)
    rows = await call.app[INSTANCES].list_instances(call.require_principal(), where)
    return InstanceList(items=[instance_out(r) for r in rows])


@api.get(
    "/api/v2/admin/instances/{instance_id}",
    response=InstanceOut,
    role=Role.viewer,
    summary="One instance",
    tag="instances",
    follower=True,
)
async def get_instance(call: Call[NoBody, NoQuery]) -> InstanceOut:
    row = await call.app[INSTANCES].get(call.require_principal(), call.match["instance_id"])
    return instance_out(row)


def _action_route(action: Action, summary: str) -> None:
    async def handler(call: Call[ShutdownBody | NoBody, NoQuery]) -> InstanceOut:
        grace = call.body.grace_seconds if isinstance(call.body, ShutdownBody) else None
        row = await call.app[INSTANCES].act(
            call.require_principal(), call.match["instance_id"], action, grace_s=grace
        )
        return instance_out(row)

    handler.__name__ = f"instance_{action.replace('-', '_')}"
    api.post(
        f"/api/v2/admin/instances/{{instance_id}}/{action}",
        body=ShutdownBody if action is Action.STOP else None,
        response=InstanceOut,
        role=Role.operator,
        summary=summary,
        tag="instances",
        responses={409: "the instance is being provisioned", 503: "its host is unreachable"},
    )(handler)


for _action, _summary in (
    (Action.START, "Start (boot) an instance"),
    (Action.STOP, "Shut down gracefully, forcing off after the grace period"),
    (Action.RESTART, "Reboot"),
    (Action.FORCE_OFF, "Power off at once"),
    (Action.SUSPEND, "Pause the vCPUs"),
    (Action.RESUME, "Resume a paused instance"),
):
    _action_route(_action, _summary)


@api.delete(
    "/api/v2/admin/instances/{instance_id}",
    role=Role.operator,
    summary="Delete an instance: domain, disks, seed, ports, record",
    tag="instances",
)
async def delete_instance(call: Call[NoBody, NoQuery]) -> None:
    await call.app[INSTANCES].delete(call.require_principal(), call.match["instance_id"])


@api.get(
    "/api/v2/admin/instances/{instance_id}/console",
    query=ConsoleQuery,
    response=ConsoleOut,
    role=Role.viewer,
    summary="The serial console log (its tail)",
    tag="instances",
)
async def console_log(call: Call[NoBody, ConsoleQuery]) -> ConsoleOut:
    tail = await call.app[INSTANCES].console(
        call.require_principal(), call.match["instance_id"], tail=call.query.tail
    )
    return ConsoleOut(instance_id=tail.instance_id, size=tail.size, text=tail.text)
