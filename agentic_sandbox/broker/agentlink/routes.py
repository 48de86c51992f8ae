"""Admin routes of the agent link: enrollment tokens, host-agent instances, agents, the CA.

`POST /api/v2/admin/agents/host-instances` registers an instance record for an agent-client
that runs on the control host itself (development, tests, bare-metal workers): there is no VM
behind it. Instances backed by VMs are created by the fleet's `POST /api/v2/admin/instances`.
With no loadout behind a host instance, the request itself may declare what a loadout would
give: its A2A skills, its task runner and its exec budgets (validated here, stored on the record,
read by the task and exec layers exactly as they read a loadout's).
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import Field, field_validator
from sqlalchemy import select

from agentic_sandbox.broker.agent_profile import (
    RunnerDeclaration,
    SkillDeclaration,
    stored_profile,
    unique_skill_ids,
)
from agentic_sandbox.broker.agentlink.enrollment import EnrollmentRefused
from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.problems import ProblemError, not_found
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision import Budgets

if TYPE_CHECKING:
    from agentic_sandbox.broker.agentlink.component import AgentLinkComponent

api = ApiRoutes()

AGENT_LINK: web.AppKey[AgentLinkComponent] = web.AppKey("agent_link")

HOST_AGENT_KIND = "host-agent"


def component(request: web.Request) -> AgentLinkComponent:
    return request.app[AGENT_LINK]


async def _visible_instance(request: web.Request, who: Principal, instance_id: str) -> m.Instance:
    async with services(request).db.session() as s:
        row = await s.get(m.Instance, instance_id)
    if row is None or row.deleted_at is not None or not who.can_see(row.owner):
        raise not_found("instance", instance_id)
    return row


# ---- host-agent instances ------------------------------------------------------------
class HostInstanceCreate(Input):
    instance_id: InstanceId
    description: str = Field(default="", max_length=256)
    skills: list[SkillDeclaration] | None = Field(
        default=None,
        max_length=100,
        description="A2A skills beside the built-in `shell` (docs/a2a.md); ids unique",
    )
    task_runner: RunnerDeclaration | None = Field(
        default=None, description="how a task's text runs (default `bash -lc {text}`)"
    )
    budgets: Budgets | None = Field(
        default=None, description="exec budgets: defaults and ceilings, as a loadout's"
    )

    _unique_skills = field_validator("skills")(unique_skill_ids)


class HostInstance(Output):
    id: str
    incarnation: str
    owner: str
    state: str
    agent_state: str
    kind: str
    description: str
    created_at: dt.datetime


@api.post(
    "/api/v2/admin/agents/host-instances",
    body=HostInstanceCreate,
    response=HostInstance,
    status=201,
    role=Role.operator,
    summary="Register an instance record for an agent-client running on the control host",
    description="For development, tests and bare-metal workers: an instance with no VM behind "
    "it, owned by the caller, that an agent-client can enroll for. VM-backed instances are "
    "created through the fleet.",
    tag="agents",
    responses={409: "an instance with this id exists"},
)
async def create_host_instance(call: Call[HostInstanceCreate, NoQuery]) -> HostInstance:
    svc = services(call.request)
    who = call.require_principal()
    body = call.body
    async with svc.db.session() as s:
        existing = await s.get(m.Instance, body.instance_id)
        if existing is not None and existing.deleted_at is None:
            raise ProblemError(
                409, f"instance {body.instance_id!r} already exists", code="instance-exists"
            )
        if existing is not None:  # a deleted instance's id: a new incarnation starts afresh
            await s.delete(existing)
            await s.flush()
        row = m.Instance(
            id=body.instance_id,
            incarnation=m.new_incarnation(),
            owner=who.subject,
            host=None,
            state="running",
            agent_state="absent",
            spec=_host_spec(body),
        )
        s.add(row)
    svc.audit.record(
        who.actor, "instance.create", "instance", row.id, detail={"kind": HOST_AGENT_KIND}
    )
    svc.events.publish(
        "instance.created",
        actor=who.actor,
        instance_id=row.id,
        owner=row.owner,
        data={"kind": HOST_AGENT_KIND},
    )
    return HostInstance(
        id=row.id,
        incarnation=row.incarnation,
        owner=row.owner,
        state=row.state,
        agent_state=row.agent_state,
        kind=HOST_AGENT_KIND,
        description=body.description,
        created_at=row.created_at,
    )


def _host_spec(body: HostInstanceCreate) -> dict[str, Any]:
    spec: dict[str, Any] = {"kind": HOST_AGENT_KIND, "description": body.description}
    spec.update(stored_profile(body.skills, body.task_runner))
    if body.budgets is not None:
        spec["budgets"] = body.budgets.model_dump(mode="json")
    return spec


# ---- enrollment tokens ------------------------------------------------------------------
class EnrollmentTokenCreate(Input):
    ttl_seconds: int | None = Field(
        default=None, ge=1, le=30 * 86400, description="default: the server's setting"
    )


class EnrollmentTokenCreated(Output):
    id: str
    instance_id: str
    token: str = Field(description="one-time enrollment token; shown once, never again")
    expires_at: dt.datetime
    ca_certificate: str = Field(description="PEM of the agent-link CA (agents verify the server)")
    grpc_listen: str = Field(description="mutual-TLS agent link (Connect, Renew)")
    grpc_enroll_listen: str = Field(description="server-auth TLS listener for Enroll")
    server_name: str = Field(description="TLS name the agent verifies")


@api.post(
    "/api/v2/admin/instances/{instance_id}/enrollment-tokens",
    body=EnrollmentTokenCreate,
    response=EnrollmentTokenCreated,
    status=201,
    role=Role.operator,
    summary="Create a one-time enrollment token for an instance's agent (shown once)",
    tag="agents",
)
async def create_enrollment_token(
    call: Call[EnrollmentTokenCreate, NoQuery],
) -> EnrollmentTokenCreated:
    from agentic_sandbox.broker.agentlink.ca import SERVER_NAME

    svc = services(call.request)
    who = call.require_principal()
    instance = await _visible_instance(call.request, who, call.match["instance_id"])
    ttl = call.body.ttl_seconds or svc.settings.enrollment_token_ttl_seconds
    link = component(call.request)
    try:
        issued = await link.enrollment.create_token(instance.id, dt.timedelta(seconds=ttl))
    except EnrollmentRefused as exc:
        raise not_found("instance", instance.id) from exc
    svc.audit.record(
        who.actor,
        "enrollment-token.create",
        "instance",
        instance.id,
        detail={"token_id": issued.id, "ttl_seconds": ttl},
    )
    return EnrollmentTokenCreated(
        id=issued.id,
        instance_id=instance.id,
        token=issued.token,
        expires_at=issued.expires_at,
        ca_certificate=link.ca.certificate_pem.decode(),
        grpc_listen=svc.settings.grpc_listen,
        grpc_enroll_listen=svc.settings.grpc_enroll_listen,
        server_name=SERVER_NAME,
    )


# ---- agents ---------------------------------------------------------------------------
class AgentStatus(Output):
    instance_id: str
    owner: str
    state: str = Field(
        description="connected | stale | disconnected | incompatible (refused: see `problem`) "
        "| absent"
    )
    problem: str = Field(
        default="", description="why the agent cannot link (a protocol this server does not speak)"
    )
    connected_at: dt.datetime | None = None
    last_heartbeat_at: dt.datetime | None = None
    peer: str | None = None
    agent_version: str = ""
    agent_bundle: str = Field(
        default="",
        description="SHA-256 of the agent bundle it runs (upgrades); empty: the one installed",
    )
    bundle_problem: str = Field(
        default="", description="why the bundle it last tried was rolled back"
    )
    hostname: str = ""
    certificate_serial: str | None = Field(
        default=None, description="serial of the client certificate the live link presented"
    )
    metrics: dict[str, Any] = Field(default_factory=dict)


class AgentList(Output):
    items: list[AgentStatus]


def _status_of(
    instance: m.Instance, link_row: m.AgentLink | None, request: web.Request
) -> AgentStatus:
    conn = component(request).registry.get(instance.id)
    if conn is not None:
        return AgentStatus(
            instance_id=instance.id,
            owner=instance.owner,
            state=conn.state if conn.state != "closed" else "disconnected",
            connected_at=conn.connected_at,
            last_heartbeat_at=conn.last_heartbeat_at,
            peer=conn.peer,
            agent_version=conn.info.agent_version,
            agent_bundle=conn.info.agent_bundle,
            bundle_problem=conn.info.bundle_problem,
            hostname=conn.info.hostname,
            certificate_serial=conn.cert_serial,
            metrics=conn.metrics.as_dict(),
        )
    problem = component(request).registry.problem(instance.id) or ""
    if link_row is not None:
        return AgentStatus(
            instance_id=instance.id,
            owner=instance.owner,
            state="incompatible" if problem else "disconnected",
            problem=problem,
            connected_at=link_row.connected_at,
            last_heartbeat_at=link_row.last_heartbeat_at,
            agent_version=link_row.agent_version,
            metrics=dict(link_row.metrics or {}),
        )
    return AgentStatus(
        instance_id=instance.id,
        owner=instance.owner,
        state="incompatible" if problem else "absent",
        problem=problem,
    )


@api.get(
    "/api/v2/admin/agents",
    response=AgentList,
    role=Role.viewer,
    summary="Agents of the instances you can see, with liveness and heartbeat metrics",
    tag="agents",
)
async def list_agents(call: Call[NoBody, NoQuery]) -> AgentList:
    svc = services(call.request)
    who = call.require_principal()
    stmt = (
        select(m.Instance, m.AgentLink)
        .outerjoin(m.AgentLink, m.AgentLink.instance_id == m.Instance.id)
        .where(m.Instance.deleted_at.is_(None))
        .order_by(m.Instance.id)
    )
    if not who.is_admin:
        stmt = stmt.where(m.Instance.owner == who.subject)
    async with svc.db.session() as s:
        rows = (await s.execute(stmt)).all()
    return AgentList(items=[_status_of(inst, link, call.request) for inst, link in rows])


@api.get(
    "/api/v2/admin/agents/{instance_id}",
    response=AgentStatus,
    role=Role.viewer,
    summary="One instance's agent: liveness and heartbeat metrics",
    tag="agents",
)
async def get_agent(call: Call[NoBody, NoQuery]) -> AgentStatus:
    svc = services(call.request)
    who = call.require_principal()
    instance = await _visible_instance(call.request, who, call.match["instance_id"])
    async with svc.db.session() as s:
        link_row = await s.get(m.AgentLink, instance.id)
    return _status_of(instance, link_row, call.request)


@api.get(
    "/api/v2/admin/agent-link/ca",
    role=Role.viewer,
    content_type="application/x-pem-file",
    summary="The agent-link CA certificate (PEM) that agents use to verify the server",
    tag="agents",
)
async def get_ca(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    pem = component(call.request).ca.certificate_pem
    return web.Response(body=pem, content_type="application/x-pem-file")
