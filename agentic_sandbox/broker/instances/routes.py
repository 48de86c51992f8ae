"""Admin routes over the fleet: instances, snapshots, clones, console, hosts, images, loadouts,
operations. Every state change is an event (the fleet's, mirrored) and audited."""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field, StringConstraints, field_validator
from sqlalchemy import func, select

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.problems import (
    ProblemError,
    conflict,
    not_found,
    not_ready,
    too_many,
)
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.instances import pools
from agentic_sandbox.broker.instances.component import FLEET_KEY, FleetComponent
from agentic_sandbox.broker.services import Services, services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import (
    Conflict,
    EgressPolicy,
    FleetError,
    HostSpec,
    HostUnavailable,
    InvalidRequest,
    NoCapacity,
    NotFound,
)
from agentic_sandbox.images import ImageNotFound
from agentic_sandbox.provision import LoadoutError, ProvisionRequest

api = ApiRoutes()

SnapshotName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]
HostName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
SshKey = Annotated[
    str,
    StringConstraints(
        pattern=r"^(ssh-(ed25519|rsa|dss)|ecdsa-sha2-nistp(256|384|521)|sk-[a-z0-9@.-]+) "
        r"[A-Za-z0-9+/=]+( [^\n\r]{0,200})?$",
        max_length=16384,
    ),
]


def fleet_of(request: web.Request) -> FleetComponent:
    comp = request.app[FLEET_KEY]
    if not comp.enabled:
        raise not_ready("the fleet is disabled (SANDBOX_LIBVIRT_URI is empty)", retry_after=60)
    if not comp.opened:
        raise not_ready("the fleet is still connecting to libvirt")
    return comp


def fleet_problem(exc: FleetError) -> ProblemError:
    if isinstance(exc, NotFound):
        return ProblemError(404, str(exc))
    if isinstance(exc, Conflict):
        return conflict(str(exc))
    if isinstance(exc, InvalidRequest):
        return ProblemError(422, str(exc))
    if isinstance(exc, NoCapacity):
        return ProblemError(409, str(exc), code="no-capacity")
    if isinstance(exc, HostUnavailable):
        return not_ready(str(exc))
    return ProblemError(502, f"libvirt failed: {exc}", code="libvirt-error")


async def visible_instance(call: Call[Any, Any], instance_id: str) -> m.Instance:
    who = call.require_principal()
    async with services(call.request).db.session() as s:
        row = await s.get(m.Instance, instance_id)
    if row is None or row.deleted_at is not None or not who.can_see(row.owner):
        raise not_found("instance", instance_id)
    return row


def instance_out(row: m.Instance) -> InstanceOut:
    out = InstanceOut.model_validate(row)
    return out.model_copy(update={"kind": str((row.spec or {}).get("kind") or "vm")})


def is_host_agent(row: m.Instance) -> bool:
    return (row.spec or {}).get("kind") == "host-agent"


def require_owner_or_admin(who: Principal, row: m.Instance) -> None:
    if not (who.is_admin or row.owner == who.subject):
        raise ProblemError(403, "only the owner or an admin may change this instance")


# ---- models --------
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
    from_snapshot: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}/[a-z0-9][a-z0-9_.-]{0,62}$",
        description="INSTANCE/SNAPSHOT: restore a memory snapshot under this new identity",
    )
    from_pool: bool = Field(default=False, description="take a restored VM from the warm pool")
    resources: ResourcesIn = ResourcesIn()
    network: Literal["isolated", "nat"] | None = None
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
        description="how long to wait for the agent (default: server's)",
    )
    loadout_spec: dict[str, Any] | None = Field(
        default=None, description="an inline loadout (as its YAML would be) instead of `loadout`"
    )


class OperationOut(Output):
    id: str
    kind: str
    subject_type: str
    subject_id: str
    owner: str
    state: str
    stage: str | None
    progress: float
    stages: list[dict[str, Any]]
    error: dict[str, Any] | None
    result: dict[str, Any] | None
    created_at: dt.datetime
    updated_at: dt.datetime


class OperationList(Output):
    items: list[OperationOut]


class InstanceOut(Output):
    id: str
    incarnation: str = Field(
        description="this create of the id: a new instance with the same id has another"
    )
    kind: str = Field(default="vm", description="vm, or host-agent (an agent on the host)")
    owner: str
    state: str
    state_reason: str
    agent_state: str
    host: str | None
    image: str | None
    loadout: str | None
    vcpus: int
    memory_mib: int
    disk_gib: int | None = None
    network_policy: str
    ssh_port: int | None
    created_at: dt.datetime
    updated_at: dt.datetime


class InstanceList(Output):
    items: list[InstanceOut]


class InstanceQuery(Input):
    state: str | None = Field(default=None, max_length=32)
    host: HostName | None = None
    owner: str | None = Field(default=None, max_length=128)
    limit: int = Field(default=500, ge=1, le=5000)


class ShutdownBody(Input):
    grace_seconds: float | None = Field(default=None, ge=0, le=3600)


# ---- instances --------
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
    return await start_provision(call)


async def start_provision(call: Call[InstanceCreate, NoQuery]) -> OperationOut:
    comp = fleet_of(call.request)
    svc = services(call.request)
    who = call.require_principal()
    body = call.body
    try:
        if body.loadout_spec is not None:
            catalog = comp.loadouts.copy()
            name = catalog.add(body.loadout_spec, "body.loadout_spec")
            loadout = catalog.resolve(name)
        else:
            loadout = comp.loadouts.resolve(body.loadout)
    except (LoadoutError, KeyError) as exc:
        raise ProblemError(
            422,
            f"body.loadout: {exc}",
            errors=[{"field": "body.loadout", "message": str(exc), "type": "value"}],
        ) from None
    source: Literal["image", "state", "pool"] = "image"
    image = None
    state_id = None
    pool_key = None
    if body.from_snapshot:
        src_id, snap = body.from_snapshot.split("/", 1)
        state_id = await memory_snapshot_state(call, src_id, snap)
        source = "state"
    elif body.from_pool:
        source = "pool"
        image_for_pool = resolve_image(comp, body.image or svc.settings.default_recipe)
        network_for_pool = body.network or loadout.network
        pool_key = pools.pool_key(image_for_pool.name, loadout.name, network_for_pool)
        if pool_key not in {p.key for p in await comp.fleet.pool_status()}:
            raise ProblemError(
                422,
                f"body.from_pool: no warm pool for image {image_for_pool.name}, loadout "
                f"{loadout.name}, network {network_for_pool} (POST /api/v2/admin/pools first)",
                errors=[{"field": "body.from_pool", "message": "no such pool", "type": "value"}],
            )
    else:
        image = resolve_image(comp, body.image or svc.settings.default_recipe)
    async with svc.db.session() as s:
        existing = await s.get(m.Instance, body.id)
        if existing is not None and existing.deleted_at is None:
            raise conflict(f"instance {body.id!r} already exists", code="instance-exists")
        count = await s.scalar(
            select(func.count())
            .select_from(m.Instance)
            .where(m.Instance.owner == who.subject, m.Instance.deleted_at.is_(None))
        )
        if (count or 0) >= svc.settings.max_instances_per_owner:
            limit = svc.settings.max_instances_per_owner
            raise too_many(
                f"{who.subject} has {count} instances (limit {limit})",
                retry_after=60,
            )
        if existing is not None:
            await s.delete(existing)
            await s.flush()
        incarnation = m.new_incarnation()
        s.add(
            m.Instance(
                id=body.id,
                incarnation=incarnation,
                owner=who.subject,
                state="provisioning",
                image=image.name if image else None,
                loadout=loadout.name,
                vcpus=body.resources.cpus or loadout.resources.cpus,
                memory_mib=body.resources.memory_mib or loadout.resources.memory_mib,
                disk_gib=body.resources.disk_gib or loadout.resources.disk_gib,
                network_policy=body.network or loadout.network,
                # exec budgets are the loadout's as it was at create (inline ones included)
                spec={"budgets": loadout.budgets.model_dump(mode="json")},
            )
        )
    svc.audit.transition(who.actor, "instance", body.id, None, "provisioning", cause=source)
    svc.events.publish(
        "instance.provisioning",
        actor=who.actor,
        owner=who.subject,
        instance_id=body.id,
        data={"source": source, "loadout": loadout.name},
    )
    req = ProvisionRequest(
        instance_id=body.id,
        incarnation=incarnation,
        owner=who.subject,
        loadout=loadout,
        source=source,
        image=image,
        state_id=state_id,
        pool_key=pool_key,
        vcpus=body.resources.cpus,
        memory_mib=body.resources.memory_mib,
        disk_gib=body.resources.disk_gib,
        network=EgressPolicy(body.network) if body.network else None,
        ssh_keys=tuple(body.ssh_keys),
        host=body.host,
        host_labels=dict(body.host_labels),
        ready_timeout=body.ready_timeout_seconds or svc.settings.provision_ready_timeout_seconds,
        wait_ready=body.wait_ready and body.start,
        start=body.start,
    )
    op = await comp.submit_provision(req, actor=who.actor, source_label=source)
    return OperationOut.model_validate(op)


def resolve_image(comp: FleetComponent, name: str) -> Any:
    """An image by name, or the cached build of a recipe by recipe name."""
    try:
        return comp.image_store.get(name)
    except ImageNotFound:
        pass
    try:
        cached = comp.builder.cached(name)
    except Exception:
        cached = None
    if cached is None:
        raise ProblemError(
            422,
            f"body.image: no image or built recipe named {name!r} "
            f'(build it first: POST /api/v2/admin/images {{"recipe": "{name}"}})',
            errors=[{"field": "body.image", "message": "unknown image", "type": "value"}],
        )
    return cached


async def memory_snapshot_state(call: Call[Any, Any], instance_id: str, snapshot: str) -> str:
    row = await visible_instance(call, instance_id)
    async with services(call.request).db.session() as s:
        snap = await s.scalar(
            select(m.Snapshot).where(m.Snapshot.instance_id == row.id, m.Snapshot.name == snapshot)
        )
    if snap is None:
        raise not_found("snapshot", f"{instance_id}/{snapshot}")
    state_id = (snap.detail or {}).get("state_id")
    if snap.kind != "memory" or not state_id:
        raise ProblemError(
            422,
            f"body.from_snapshot: {instance_id}/{snapshot} has no memory state to restore; "
            "take a snapshot with memory",
        )
    return str(state_id)


@api.get(
    "/api/v2/admin/instances",
    query=InstanceQuery,
    response=InstanceList,
    role=Role.viewer,
    summary="List instances (yours, or all as admin)",
    tag="instances",
)
async def list_instances(call: Call[NoBody, InstanceQuery]) -> InstanceList:
    who = call.require_principal()
    q = call.query
    stmt = select(m.Instance).where(m.Instance.deleted_at.is_(None)).order_by(m.Instance.id)
    if not who.is_admin:
        stmt = stmt.where(m.Instance.owner == who.subject)
    elif q.owner:
        stmt = stmt.where(m.Instance.owner == q.owner)
    if q.state:
        stmt = stmt.where(m.Instance.state == q.state)
    if q.host:
        stmt = stmt.where(m.Instance.host == q.host)
    async with services(call.request).db.session() as s:
        rows = (await s.scalars(stmt.limit(q.limit))).all()
    return InstanceList(items=[instance_out(r) for r in rows])


@api.get(
    "/api/v2/admin/instances/{instance_id}",
    response=InstanceOut,
    role=Role.viewer,
    summary="One instance",
    tag="instances",
)
async def get_instance(call: Call[NoBody, NoQuery]) -> InstanceOut:
    return instance_out(await visible_instance(call, call.match["instance_id"]))


async def _lifecycle(call: Call[Any, Any], action: str) -> InstanceOut:
    who = call.require_principal()
    row = await visible_instance(call, call.match["instance_id"])
    require_owner_or_admin(who, row)
    if is_host_agent(row):
        raise conflict(f"instance {row.id} is an agent on the host: it has no VM to {action}")
    comp = fleet_of(call.request)
    if row.state == "provisioning":
        raise conflict(f"instance {row.id} is still being provisioned")
    f = comp.fleet
    try:
        if action == "start":
            await f.start(row.id)
        elif action == "stop":
            grace = getattr(call.body, "grace_seconds", None)
            await f.shutdown(row.id, grace_s=grace)
        elif action == "restart":
            await f.reboot(row.id)
        elif action == "force-off":
            await f.force_off(row.id)
        elif action == "suspend":
            await f.suspend(row.id)
        elif action == "resume":
            await f.resume(row.id)
    except FleetError as exc:
        raise fleet_problem(exc) from None
    inst = await f.get(row.id)
    services(call.request).audit.record(who.actor, f"instance.{action}", "instance", row.id)
    async with services(call.request).db.session() as s:
        fresh = await s.get(m.Instance, row.id)
        assert fresh is not None
        fresh.state = inst.state.value
        fresh.state_reason = inst.state_reason
        return instance_out(fresh)


def _action_route(action: str, summary: str) -> None:
    body_model = ShutdownBody if action == "stop" else None

    async def handler(call: Call[Any, NoQuery]) -> InstanceOut:
        return await _lifecycle(call, action)

    handler.__name__ = f"instance_{action.replace('-', '_')}"
    api.post(
        f"/api/v2/admin/instances/{{instance_id}}/{action}",
        body=body_model,
        response=InstanceOut,
        role=Role.operator,
        summary=summary,
        tag="instances",
        responses={409: "the instance is being provisioned", 503: "its host is unreachable"},
    )(handler)


for _action, _summary in (
    ("start", "Start (boot) an instance"),
    ("stop", "Shut down gracefully, forcing off after the grace period"),
    ("restart", "Reboot"),
    ("force-off", "Power off at once"),
    ("suspend", "Pause the vCPUs"),
    ("resume", "Resume a paused instance"),
):
    _action_route(_action, _summary)


@api.delete(
    "/api/v2/admin/instances/{instance_id}",
    role=Role.operator,
    summary="Delete an instance: domain, disks, seed, ports, record",
    tag="instances",
)
async def delete_instance(call: Call[NoBody, NoQuery]) -> None:
    svc = services(call.request)
    who = call.require_principal()
    row = await visible_instance(call, call.match["instance_id"])
    require_owner_or_admin(who, row)
    if not is_host_agent(row):  # a host agent has no VM: only its record and credentials
        comp = fleet_of(call.request)
        try:
            await comp.fleet.delete(row.id)
        except FleetError as exc:
            raise fleet_problem(exc) from None
        async with svc.db.session() as s:
            snaps = (
                await s.scalars(select(m.Snapshot).where(m.Snapshot.instance_id == row.id))
            ).all()
            for snap in snaps:
                state_id = (snap.detail or {}).get("state_id")
                if state_id:
                    try:
                        await comp.fleet.delete_state(state_id)
                    except FleetError:
                        pass  # still backing a clone: kept until that clone goes
                await s.delete(snap)
    await end_instance(svc, row.id, actor=who.actor, reason=f"deleted by {who.actor}")


async def end_instance(svc: Services, instance_id: str, *, actor: str, reason: str) -> None:
    """Mark the instance deleted and end its incarnation: nothing bound to it survives (its
    agent link, certificates, tokens, A2A keys, secret bindings, shares, sessions, tasks)."""
    async with svc.db.session() as s:
        fresh = await s.get(m.Instance, instance_id)
        if fresh is None or fresh.deleted_at is not None:
            return
        before, incarnation, owner = fresh.state, fresh.incarnation, fresh.owner
        fresh.state = "deleted"
        fresh.deleted_at = dt.datetime.now(dt.UTC)
    svc.audit.transition(actor, "instance", instance_id, before, "deleted", cause=reason)
    failed = await svc.incarnations.end(instance_id, incarnation, actor=actor, reason=reason)
    svc.events.publish(
        "instance.deleted",
        actor=actor,
        owner=owner,
        instance_id=instance_id,
        data={"incarnation": incarnation, **({"cleanup_failed": failed} if failed else {})},
    )


# ---- snapshots --------
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
    detail: dict[str, Any]


class SnapshotList(Output):
    items: list[SnapshotOut]


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
    import uuid

    comp = fleet_of(call.request)
    svc = services(call.request)
    who = call.require_principal()
    row = await visible_instance(call, call.match["instance_id"])
    require_owner_or_admin(who, row)
    name = call.body.name
    async with svc.db.session() as s:
        dup = await s.scalar(
            select(m.Snapshot).where(m.Snapshot.instance_id == row.id, m.Snapshot.name == name)
        )
    if dup is not None:
        raise conflict(f"instance {row.id} already has a snapshot {name!r}")
    detail: dict[str, Any] = {"description": call.body.description}
    try:
        if call.body.memory:
            state_id = f"{row.id}--{name}"[:63].rstrip("-.")
            state_id = re.sub(r"[^a-z0-9_.-]", "-", state_id)
            await comp.fleet.capture_state(row.id, state_id, keep_running=True)
            detail["state_id"] = state_id
            info = await comp.fleet.create_snapshot(
                row.id, name, with_memory=True, description=call.body.description
            )
        else:
            info = await comp.fleet.create_snapshot(
                row.id, name, with_memory=False, description=call.body.description
            )
    except FleetError as exc:
        raise fleet_problem(exc) from None
    detail["domain_state"] = info.domain_state
    snap = m.Snapshot(
        id=str(uuid.uuid4()),
        instance_id=row.id,
        name=name,
        kind="memory" if call.body.memory else "disk",
        owner=row.owner,
        detail=detail,
    )
    async with svc.db.session() as s:
        s.add(snap)
    svc.audit.record(who.actor, "snapshot.create", "instance", row.id, detail={"name": name})
    return SnapshotOut.model_validate(snap)


@api.get(
    "/api/v2/admin/instances/{instance_id}/snapshots",
    response=SnapshotList,
    role=Role.viewer,
    summary="List an instance's snapshots",
    tag="snapshots",
)
async def list_snapshots(call: Call[NoBody, NoQuery]) -> SnapshotList:
    row = await visible_instance(call, call.match["instance_id"])
    async with services(call.request).db.session() as s:
        rows = (
            await s.scalars(
                select(m.Snapshot)
                .where(m.Snapshot.instance_id == row.id)
                .order_by(m.Snapshot.created_at)
            )
        ).all()
    return SnapshotList(items=[SnapshotOut.model_validate(r) for r in rows])


async def _snapshot_row(call: Call[Any, Any]) -> tuple[m.Instance, m.Snapshot]:
    row = await visible_instance(call, call.match["instance_id"])
    name = call.match["name"]
    async with services(call.request).db.session() as s:
        snap = await s.scalar(
            select(m.Snapshot).where(m.Snapshot.instance_id == row.id, m.Snapshot.name == name)
        )
    if snap is None:
        raise not_found("snapshot", f"{row.id}/{name}")
    return row, snap


@api.post(
    "/api/v2/admin/instances/{instance_id}/snapshots/{name}/revert",
    response=InstanceOut,
    role=Role.operator,
    summary="Revert an instance to a snapshot",
    tag="snapshots",
)
async def revert_snapshot(call: Call[NoBody, NoQuery]) -> InstanceOut:
    comp = fleet_of(call.request)
    who = call.require_principal()
    row, snap = await _snapshot_row(call)
    require_owner_or_admin(who, row)
    try:
        inst = await comp.fleet.revert_snapshot(row.id, snap.name)
    except FleetError as exc:
        raise fleet_problem(exc) from None
    services(call.request).audit.record(
        who.actor, "snapshot.revert", "instance", row.id, detail={"name": snap.name}
    )
    async with services(call.request).db.session() as s:
        fresh = await s.get(m.Instance, row.id)
        assert fresh is not None
        fresh.state = inst.state.value
        return instance_out(fresh)


@api.delete(
    "/api/v2/admin/instances/{instance_id}/snapshots/{name}",
    role=Role.operator,
    summary="Delete a snapshot",
    tag="snapshots",
    responses={409: "a clone still runs on this snapshot's memory state"},
)
async def delete_snapshot(call: Call[NoBody, NoQuery]) -> None:
    comp = fleet_of(call.request)
    who = call.require_principal()
    row, snap = await _snapshot_row(call)
    require_owner_or_admin(who, row)
    try:
        state_id = (snap.detail or {}).get("state_id")
        if state_id:
            await comp.fleet.delete_state(state_id)
        await comp.fleet.delete_snapshot(row.id, snap.name)
    except FleetError as exc:
        raise fleet_problem(exc) from None
    async with services(call.request).db.session() as s:
        live = await s.get(m.Snapshot, snap.id)
        if live is not None:
            await s.delete(live)
    services(call.request).audit.record(
        who.actor, "snapshot.delete", "instance", row.id, detail={"name": snap.name}
    )


class CloneBody(Input):
    new_id: InstanceId
    snapshot: SnapshotName
    ssh_keys: list[SshKey] = Field(default_factory=list, max_length=32)
    wait_ready: bool = True


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
    src = call.match["instance_id"]
    body = InstanceCreate(
        id=call.body.new_id,
        from_snapshot=f"{src}/{call.body.snapshot}",
        ssh_keys=call.body.ssh_keys,
        wait_ready=call.body.wait_ready,
        loadout=(await visible_instance(call, src)).loadout or "minimal",
    )
    return await start_provision(Call(call.request, body, NoQuery(), call.principal))


class ConsoleQuery(Input):
    tail: int = Field(default=64 * 1024, ge=1, le=16 * 1024 * 1024, description="bytes")


class ConsoleOut(Output):
    instance_id: str
    size: int
    text: str


@api.get(
    "/api/v2/admin/instances/{instance_id}/console",
    query=ConsoleQuery,
    response=ConsoleOut,
    role=Role.viewer,
    summary="The serial console log (its tail)",
    tag="instances",
)
async def console_log(call: Call[NoBody, ConsoleQuery]) -> ConsoleOut:
    comp = fleet_of(call.request)
    row = await visible_instance(call, call.match["instance_id"])
    try:
        data = await comp.fleet.read_serial_log(row.id)
    except FleetError as exc:
        raise fleet_problem(exc) from None
    tail = data[-call.query.tail :]
    text = tail.decode("utf-8", "replace")
    from agentic_sandbox.broker.observability.logs import redactor

    return ConsoleOut(instance_id=row.id, size=len(data), text=redactor.text(text))


# ---- operations --------
class OperationQuery(Input):
    subject_id: str | None = Field(default=None, max_length=128)
    state: str | None = Field(default=None, max_length=16)
    limit: int = Field(default=100, ge=1, le=1000)


@api.get(
    "/api/v2/admin/operations",
    query=OperationQuery,
    response=OperationList,
    role=Role.viewer,
    summary="Long-running operations (provisioning, image builds), newest first",
    tag="operations",
)
async def list_operations(call: Call[NoBody, OperationQuery]) -> OperationList:
    who = call.require_principal()
    stmt = select(m.Operation).order_by(m.Operation.created_at.desc())
    if not who.is_admin:
        stmt = stmt.where(m.Operation.owner == who.subject)
    if call.query.subject_id:
        stmt = stmt.where(m.Operation.subject_id == call.query.subject_id)
    if call.query.state:
        stmt = stmt.where(m.Operation.state == call.query.state)
    async with services(call.request).db.session() as s:
        rows = (await s.scalars(stmt.limit(call.query.limit))).all()
    return OperationList(items=[OperationOut.model_validate(r) for r in rows])


async def _visible_operation(call: Call[Any, Any]) -> m.Operation:
    who = call.require_principal()
    op_id = call.match["operation_id"]
    op = await call.request.app[FLEET_KEY].ops.get(op_id)
    if op is None or not who.can_see(op.owner):
        raise not_found("operation", op_id)
    return op


@api.get(
    "/api/v2/admin/operations/{operation_id}",
    response=OperationOut,
    role=Role.viewer,
    summary="One operation with its stages and progress",
    tag="operations",
)
async def get_operation(call: Call[NoBody, NoQuery]) -> OperationOut:
    return OperationOut.model_validate(await _visible_operation(call))


@api.post(
    "/api/v2/admin/operations/{operation_id}/cancel",
    response=OperationOut,
    role=Role.operator,
    summary="Cancel a running operation (its half-made work is cleaned up)",
    tag="operations",
)
async def cancel_operation(call: Call[NoBody, NoQuery]) -> OperationOut:
    op = await _visible_operation(call)
    comp = call.request.app[FLEET_KEY]
    await comp.ops.cancel(op.id)
    fresh = await comp.ops.get(op.id)
    assert fresh is not None
    return OperationOut.model_validate(fresh)


# ---- hosts --------
class HostCreate(Input):
    name: HostName
    uri: str = Field(min_length=3, max_length=512, pattern=r"^(qemu|test)(\+[a-z]+)?://")
    labels: dict[Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")], str] = (
        Field(default_factory=dict, max_length=32)
    )
    capacity_vcpus: int | None = Field(default=None, ge=1)
    capacity_memory_mib: int | None = Field(default=None, ge=256)
    ssh_port_range: tuple[int, int] | None = None

    @field_validator("ssh_port_range")
    @classmethod
    def _range(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1024 <= value[0] <= value[1] <= 65535:
            raise ValueError("must be [low, high] within 1024..65535")
        return value


class HostOut(Output):
    name: str
    uri: str
    labels: dict[str, str]
    state: str
    reason: str
    accel: str | None
    cpus: int
    memory_mib: int
    free_memory_mib: int
    committed_vcpus: int
    committed_memory_mib: int
    instances: int


class HostList(Output):
    items: list[HostOut]


def _host_out(info: Any) -> HostOut:
    return HostOut(
        name=info.spec.name,
        uri=info.spec.uri,
        labels=dict(info.spec.labels),
        state="reachable" if info.reachable else "unreachable",
        reason=info.reason,
        accel=info.accel.value if info.accel is not None else None,
        cpus=info.cpus,
        memory_mib=info.memory_mib,
        free_memory_mib=info.free_memory_mib,
        committed_vcpus=info.committed_vcpus,
        committed_memory_mib=info.committed_memory_mib,
        instances=info.instances,
    )


@api.get(
    "/api/v2/admin/hosts",
    response=HostList,
    role=Role.viewer,
    summary="Hypervisor hosts with capacity and reachability",
    tag="hosts",
)
async def list_hosts(call: Call[NoBody, NoQuery]) -> HostList:
    comp = fleet_of(call.request)
    return HostList(items=[_host_out(h) for h in await comp.fleet.list_hosts()])


@api.post(
    "/api/v2/admin/hosts",
    body=HostCreate,
    response=HostOut,
    status=201,
    role=Role.admin,
    summary="Add a host by libvirt URI (kept and retried if unreachable now)",
    tag="hosts",
)
async def add_host(call: Call[HostCreate, NoQuery]) -> HostOut:
    comp = fleet_of(call.request)
    svc = services(call.request)
    who = call.require_principal()
    b = call.body
    capacity: dict[str, Any] = {}
    if b.capacity_vcpus:
        capacity["vcpus"] = b.capacity_vcpus
    if b.capacity_memory_mib:
        capacity["memory_mib"] = b.capacity_memory_mib
    extra: dict[str, Any] = {}
    if b.ssh_port_range:
        extra["ssh_port_range"] = b.ssh_port_range
    spec = HostSpec(name=b.name, uri=b.uri, labels=b.labels, capacity=capacity, **extra)
    try:
        info = await comp.fleet.add_host(spec)
    except FleetError as exc:
        raise fleet_problem(exc) from None
    labels: dict[str, Any] = dict(b.labels)
    if extra:
        labels["_spec"] = {"ssh_port_range": list(b.ssh_port_range or ())}
    async with svc.db.session() as s:
        row = await s.get(m.Host, b.name)
        if row is None:
            row = m.Host(name=b.name, uri=b.uri, owner=who.subject)
            s.add(row)
        row.labels = labels
        row.capacity_vcpus = b.capacity_vcpus
        row.capacity_memory_mib = b.capacity_memory_mib
        row.state = "reachable" if info.reachable else "unreachable"
        row.state_reason = info.reason
    svc.audit.record(who.actor, "host.add", "host", b.name, detail={"uri": b.uri})
    return _host_out(info)


@api.get(
    "/api/v2/admin/hosts/{name}",
    response=HostOut,
    role=Role.viewer,
    summary="One host",
    tag="hosts",
)
async def get_host(call: Call[NoBody, NoQuery]) -> HostOut:
    comp = fleet_of(call.request)
    try:
        return _host_out(await comp.fleet.host_info(call.match["name"]))
    except FleetError as exc:
        raise fleet_problem(exc) from None


class HostRemoveQuery(Input):
    force: bool = False


@api.delete(
    "/api/v2/admin/hosts/{name}",
    query=HostRemoveQuery,
    role=Role.admin,
    summary="Remove a host (refused while it has instances, unless force)",
    tag="hosts",
)
async def remove_host(call: Call[NoBody, HostRemoveQuery]) -> None:
    comp = fleet_of(call.request)
    svc = services(call.request)
    who = call.require_principal()
    name = call.match["name"]
    if name == "local":
        raise conflict("the local host cannot be removed (set SANDBOX_LIBVIRT_URI instead)")
    try:
        await comp.fleet.remove_host(name, force=call.query.force)
    except FleetError as exc:
        raise fleet_problem(exc) from None
    async with svc.db.session() as s:
        row = await s.get(m.Host, name)
        if row is not None:
            await s.delete(row)
    svc.audit.record(who.actor, "host.remove", "host", name)


# ---- images and loadouts --------
class ImageBuild(Input):
    recipe: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")


class ImageOut(Output):
    name: str
    kind: str
    recipe: str | None
    state: str
    size_bytes: int | None
    created_at: str | None
    needs_agent_runtime: bool


class ImageList(Output):
    items: list[ImageOut]


@api.post(
    "/api/v2/admin/images",
    body=ImageBuild,
    response=OperationOut,
    status=202,
    role=Role.admin,
    summary="Build an image from a recipe (a cached build is reused at once)",
    tag="images",
)
async def build_image(call: Call[ImageBuild, NoQuery]) -> OperationOut:
    comp = call.request.app[FLEET_KEY]
    who = call.require_principal()
    from agentic_sandbox.images import list_recipes

    if call.body.recipe not in list_recipes():
        raise ProblemError(
            422,
            f"body.recipe: unknown recipe {call.body.recipe!r}; known: {', '.join(list_recipes())}",
            errors=[{"field": "body.recipe", "message": "unknown recipe", "type": "value"}],
        )
    op = await comp.submit_image_build(call.body.recipe, owner=who.subject, actor=who.actor)
    return OperationOut.model_validate(op)


@api.get(
    "/api/v2/admin/images",
    response=ImageList,
    role=Role.viewer,
    summary="Images in the cache",
    tag="images",
)
async def list_images(call: Call[NoBody, NoQuery]) -> ImageList:
    comp = call.request.app[FLEET_KEY]
    items = []
    for image in comp.image_store.list():
        man = image.manifest
        items.append(
            ImageOut(
                name=image.name,
                kind=image.kind,
                recipe=man.recipe_name,
                state="ready",
                size_bytes=man.disk.actual_size,
                created_at=man.created_at,
                needs_agent_runtime=image.needs_agent_runtime,
            )
        )
    return ImageList(items=items)


@api.delete(
    "/api/v2/admin/images/{name}",
    role=Role.admin,
    summary="Delete an image from the cache",
    tag="images",
    responses={409: "instances still use it"},
)
async def delete_image(call: Call[NoBody, NoQuery]) -> None:
    comp = call.request.app[FLEET_KEY]
    svc = services(call.request)
    who = call.require_principal()
    name = call.match["name"]
    async with svc.db.session() as s:
        users = await s.scalar(
            select(func.count())
            .select_from(m.Instance)
            .where(m.Instance.image == name, m.Instance.deleted_at.is_(None))
        )
    if users:
        raise conflict(f"{users} instance(s) still use image {name}")
    try:
        comp.image_store.delete(name)
    except ImageNotFound:
        raise not_found("image", name) from None
    async with svc.db.session() as s:
        row = await s.get(m.Image, name)
        if row is not None:
            await s.delete(row)
    svc.audit.record(who.actor, "image.delete", "image", name)


class LoadoutOut(Output):
    name: str
    description: str
    network: str
    resources: dict[str, int]
    packages: list[str]
    skills: list[dict[str, Any]]
    task_runner: dict[str, Any]
    sudo: bool


class LoadoutList(Output):
    items: list[LoadoutOut]


def _loadout_out(comp: FleetComponent, name: str) -> LoadoutOut:
    lo = comp.loadouts.resolve(name)
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
    comp = call.request.app[FLEET_KEY]
    return LoadoutList(items=[_loadout_out(comp, n) for n in comp.loadouts.names()])


@api.get(
    "/api/v2/admin/loadouts/{name}",
    response=LoadoutOut,
    role=Role.viewer,
    summary="One loadout",
    tag="loadouts",
)
async def get_loadout(call: Call[NoBody, NoQuery]) -> LoadoutOut:
    comp = call.request.app[FLEET_KEY]
    name = call.match["name"]
    if name not in comp.loadouts.names():
        raise not_found("loadout", name)
    return _loadout_out(comp, name)


# ---- warm pools --------------------------------------------------------------------------------
class PoolCreate(Input):
    image: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9_.-]{0,127}$")
    loadout: str = Field(default="minimal", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    network: Literal["isolated", "nat"] | None = None
    size: int = Field(default=2, ge=0, le=64)


class PoolOut(Output):
    key: str
    image: str
    loadout: str
    network: str
    size: int
    ready: int
    last_error: str


class PoolList(Output):
    items: list[PoolOut]


@api.post(
    "/api/v2/admin/pools",
    body=PoolCreate,
    response=OperationOut,
    status=202,
    role=Role.admin,
    summary="Prepare (or resize) a warm pool for an image + loadout + network",
    tag="pools",
)
async def create_pool(call: Call[PoolCreate, NoQuery]) -> OperationOut:
    comp = fleet_of(call.request)
    svc = services(call.request)
    who = call.require_principal()
    image = resolve_image(comp, call.body.image or svc.settings.default_recipe)
    try:
        loadout = comp.loadouts.resolve(call.body.loadout)
    except LoadoutError as exc:
        raise ProblemError(422, f"body.loadout: {exc}") from None
    network = EgressPolicy(call.body.network or loadout.network)
    size = call.body.size

    async def body(progress: Any) -> dict[str, Any]:
        return await pools.prepare(
            comp, progress, image=image, loadout=loadout, network=network, size=size
        )

    op = await comp.ops.submit(
        kind="pool-prepare",
        subject_type="pool",
        subject_id=pools.pool_key(image.name, loadout.name, network.value),
        owner=who.subject,
        actor=who.actor,
        body=body,
        planned=("golden", "settling", "saving", "filling"),
    )
    svc.audit.record(who.actor, "pool.prepare", "pool", op.subject_id, detail={"size": size})
    return OperationOut.model_validate(op)


@api.get(
    "/api/v2/admin/pools",
    response=PoolList,
    role=Role.viewer,
    summary="Warm pools and how many VMs each has ready",
    tag="pools",
)
async def list_pools(call: Call[NoBody, NoQuery]) -> PoolList:
    comp = fleet_of(call.request)
    status = {p.key: p for p in await comp.fleet.pool_status()}
    items = []
    for pool in await pools.saved_pools(comp):
        st = status.get(pool["key"])
        items.append(
            PoolOut(
                key=pool["key"],
                image=pool["image"],
                loadout=pool["loadout"],
                network=pool["network"],
                size=int(pool["size"]),
                ready=st.ready if st else 0,
                last_error=st.last_error if st else "not configured",
            )
        )
    return PoolList(items=items)


@api.delete(
    "/api/v2/admin/pools/{key}",
    role=Role.admin,
    summary="Drain and remove a warm pool",
    tag="pools",
)
async def delete_pool(call: Call[NoBody, NoQuery]) -> None:
    comp = fleet_of(call.request)
    who = call.require_principal()
    key = call.match["key"]
    if not await pools.remove(comp, key):
        raise not_found("pool", key)
    services(call.request).audit.record(who.actor, "pool.remove", "pool", key)
