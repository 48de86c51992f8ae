"""Admin routes for secrets: values go in, never come out."""

from __future__ import annotations

import datetime as dt

from pydantic import Field
from sqlalchemy import delete, select

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.auth.routes import live_instance
from agentic_sandbox.broker.http.problems import ProblemError, not_found
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.secrets.vault import SECRET_NAME_RE, VaultError
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

api = ApiRoutes()


class SecretPut(Input):
    value: str = Field(min_length=1, max_length=64 * 1024, description="write-only")
    instances: list[InstanceId] = Field(
        default_factory=list, max_length=1000, description="instances this secret is bound to"
    )
    env_name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="environment variable name in the instance (default: the secret's name)",
    )


class SecretInfo(Output):
    name: str
    owner: str
    version: int
    instances: list[str]
    created_at: dt.datetime
    updated_at: dt.datetime


class SecretList(Output):
    items: list[SecretInfo]


def _check_name(name: str) -> None:
    if not SECRET_NAME_RE.match(name):
        raise ProblemError(
            422,
            "path.name: must match [A-Za-z_][A-Za-z0-9_.-]{0,127}",
            errors=[{"field": "path.name", "message": "invalid secret name", "type": "pattern"}],
        )


async def _info(db: Database, row: m.Secret) -> SecretInfo:
    async with db.session() as s:
        bound = (
            await s.scalars(
                select(m.SecretBinding.instance_id).where(m.SecretBinding.secret_id == row.id)
            )
        ).all()
    return SecretInfo(
        name=row.name,
        owner=row.owner,
        version=row.version,
        instances=sorted(bound),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


@api.put(
    "/api/v2/admin/secrets/{name}",
    body=SecretPut,
    response=SecretInfo,
    role=Role.operator,
    summary="Set a secret (create or replace); the value is never returned",
    responses={201: "created"},
    tag="secrets",
)
async def put_secret(call: Call[SecretPut, NoQuery]) -> SecretInfo:
    svc = services(call.request)
    who = call.require_principal()
    name = call.match["name"]
    _check_name(name)
    incarnations: dict[str, str] = {}
    for inst in call.body.instances:
        live = await live_instance(call.request, inst)
        if live is None or not who.can_see(live[0]):
            raise not_found("instance", inst)
        incarnations[inst] = live[1]
    try:
        row, created = await svc.vault.put(who.subject, name, call.body.value)
    except VaultError as exc:
        raise ProblemError(422, str(exc)) from None
    async with svc.db.session() as s:
        await s.execute(delete(m.SecretBinding).where(m.SecretBinding.secret_id == row.id))
        for inst in sorted(incarnations):
            s.add(
                m.SecretBinding(
                    secret_id=row.id,
                    instance_id=inst,
                    incarnation=incarnations[inst],
                    env_name=call.body.env_name,
                )
            )
    svc.audit.record(
        who.actor,
        "secret.create" if created else "secret.update",
        "secret",
        f"{who.subject}/{name}",
    )
    call.status = 201 if created else 200
    return await _info(svc.db, row)


@api.get(
    "/api/v2/admin/secrets",
    response=SecretList,
    role=Role.viewer,
    summary="List secrets (names and bindings only, never values)",
    tag="secrets",
)
async def list_secrets(call: Call[NoBody, NoQuery]) -> SecretList:
    svc = services(call.request)
    who = call.require_principal()
    stmt = select(m.Secret).order_by(m.Secret.owner, m.Secret.name)
    if not who.is_admin:
        stmt = stmt.where(m.Secret.owner == who.subject)
    async with svc.db.session() as s:
        rows = (await s.scalars(stmt)).all()
    return SecretList(items=[await _info(svc.db, r) for r in rows])


@api.delete(
    "/api/v2/admin/secrets/{name}",
    role=Role.operator,
    summary="Delete one of your secrets",
    tag="secrets",
)
async def delete_secret(call: Call[NoBody, NoQuery]) -> None:
    svc = services(call.request)
    who = call.require_principal()
    name = call.match["name"]
    _check_name(name)
    async with svc.db.session() as s:
        row = await s.scalar(
            select(m.Secret).where(m.Secret.owner == who.subject, m.Secret.name == name)
        )
        if row is None:
            raise not_found("secret", name)
        await s.delete(row)
    svc.audit.record(who.actor, "secret.delete", "secret", f"{who.subject}/{name}")
