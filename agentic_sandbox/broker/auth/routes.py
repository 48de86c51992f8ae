"""Admin routes for operator tokens and API keys, and the dashboard login."""

from __future__ import annotations

import datetime as dt

from aiohttp import web
from pydantic import Field

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.problems import ProblemError, not_found
from agentic_sandbox.broker.http.routing import (
    AUTH_ERROR,
    CSRF_TOKEN,
    ApiRoutes,
    Call,
    NoBody,
    NoQuery,
)
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output, SubjectName
from agentic_sandbox.broker.services import services

api = ApiRoutes()

SESSION_COOKIE = "sbx_session"


class TokenCreate(Input):
    subject: SubjectName = Field(description="owner name the token acts as")
    role: Role = Role.operator
    description: str = Field(default="", max_length=256)
    expires_in_seconds: int | None = Field(default=None, ge=60, le=10 * 365 * 86400)


class TokenInfo(Output):
    id: str
    subject: str
    role: Role
    description: str
    prefix: str
    created_at: dt.datetime
    created_by: str | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


class TokenCreated(TokenInfo):
    token: str = Field(description="the token itself; shown once, never again")


class TokenList(Output):
    items: list[TokenInfo]


class WhoAmI(Output):
    subject: str
    role: Role
    kind: str
    credential_id: str
    csrf_token: str | None = None


class LoginBody(Input):
    token: str = Field(min_length=8, max_length=200)


@api.post(
    "/api/v2/admin/tokens",
    body=TokenCreate,
    response=TokenCreated,
    status=201,
    role=Role.admin,
    summary="Create an operator token (the value is shown once)",
    tag="tokens",
)
async def create_token(call: Call[TokenCreate, NoQuery]) -> TokenCreated:
    svc = services(call.request)
    who = call.require_principal()
    body = call.body
    expires = (
        dt.datetime.now(dt.UTC) + dt.timedelta(seconds=body.expires_in_seconds)
        if body.expires_in_seconds
        else None
    )
    issued = await svc.auth.create_token(
        subject=body.subject,
        role=body.role,
        description=body.description,
        created_by=who.subject,
        expires_at=expires,
    )
    row = await svc.auth.get_token(issued.id)
    assert row is not None
    svc.audit.record(who.actor, "token.create", "token", row.id, detail={"role": row.role})
    return TokenCreated(**TokenInfo.model_validate(row).model_dump(), token=issued.secret)


@api.get(
    "/api/v2/admin/tokens",
    response=TokenList,
    role=Role.viewer,
    summary="List operator tokens (admins see all; others only the one they call with)",
    tag="tokens",
)
async def list_tokens(call: Call[NoBody, NoQuery]) -> TokenList:
    who = call.require_principal()
    auth = services(call.request).auth
    if who.is_admin:
        rows = await auth.list_tokens()
    else:
        own = await auth.get_token(who.credential_id)
        rows = [own] if own is not None else []
    return TokenList(items=[TokenInfo.model_validate(r) for r in rows])


def may_revoke(who: Principal, token_id: str, role: Role) -> bool:
    """Admins revoke any token; everyone else only the credential they call with. Nobody
    revokes a token of a higher role than their own. Identity is the credential's id, never
    its subject: a subject is a reusable name (a viewer can be called `admin`)."""
    if role.rank > who.role.rank:
        return False
    return who.is_admin or token_id == who.credential_id


@api.delete(
    "/api/v2/admin/tokens/{token_id}",
    role=Role.viewer,
    summary="Revoke an operator token (your own; admins any): its WebSocket and SSE streams "
    "end at once",
    tag="tokens",
)
async def revoke_token(call: Call[NoBody, NoQuery]) -> None:
    svc = services(call.request)
    who = call.require_principal()
    token_id = call.match["token_id"]
    row = await svc.auth.get_token(token_id)
    if row is None or not may_revoke(who, row.id, Role(row.role)):
        # Not yours (or above you) is indistinguishable from not there.
        raise not_found("token", token_id)
    await svc.auth.revoke_token(token_id)
    svc.audit.record(who.actor, "token.revoke", "token", token_id, detail={"role": row.role})


@api.get(
    "/api/v2/admin/whoami",
    response=WhoAmI,
    role=Role.viewer,
    summary="The caller's identity and role",
    tag="tokens",
)
async def whoami(call: Call[NoBody, NoQuery]) -> WhoAmI:
    who = call.require_principal()
    return WhoAmI(
        subject=who.subject,
        role=who.role,
        kind=who.kind,
        credential_id=who.credential_id,
        csrf_token=call.request.get(CSRF_TOKEN),
    )


@api.post(
    "/api/v2/admin/login",
    body=LoginBody,
    response=WhoAmI,
    role=None,
    summary="Dashboard login: exchange a token for an HttpOnly session cookie",
    tag="tokens",
    responses={401: "invalid token"},
)
async def login(call: Call[LoginBody, NoQuery]) -> web.StreamResponse:
    svc = services(call.request)
    result = await svc.auth.login(call.body.token)
    if result is None:
        call.request[AUTH_ERROR] = "login with an invalid token"
        raise ProblemError(401, "the token is invalid, expired or revoked", code="invalid-token")
    cookie, csrf, principal = result
    svc.audit.record(principal.actor, "login", "token", principal.credential_id)
    body = WhoAmI(
        subject=principal.subject,
        role=principal.role,
        kind="cookie",
        credential_id=principal.credential_id,
        csrf_token=csrf,
    )
    resp = web.json_response(body.model_dump(mode="json"))
    resp.set_cookie(
        SESSION_COOKIE,
        cookie,
        httponly=True,
        samesite="Strict",
        secure=svc.settings.cookie_secure,
        path="/",
        max_age=svc.settings.web_session_ttl_seconds,
    )
    return resp


@api.post(
    "/api/v2/admin/logout",
    role=None,
    summary="End the dashboard session",
    tag="tokens",
)
async def logout(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    cookie = call.request.cookies.get(SESSION_COOKIE)
    if cookie:
        await services(call.request).auth.logout(cookie)
    resp = web.Response(status=204)
    resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


# ---- A2A API keys ---------------------------------------------------------------------------
class ApiKeyCreate(Input):
    instance_id: InstanceId
    scopes: list[str] = Field(default_factory=lambda: ["a2a:read", "a2a:invoke"], min_length=1)
    name: str = Field(default="", max_length=128)
    expires_in_seconds: int | None = Field(default=None, ge=60, le=10 * 365 * 86400)


class ApiKeyInfo(Output):
    id: str
    instance_id: str
    owner: str
    name: str
    scopes: list[str]
    prefix: str
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


class ApiKeyCreated(ApiKeyInfo):
    key: str = Field(description="the key itself; shown once, never again")


class ApiKeyList(Output):
    items: list[ApiKeyInfo]


class ApiKeyQuery(Input):
    instance_id: InstanceId | None = None


def _can_use_instance(who: Principal, owner: str) -> bool:
    return who.can_see(owner)


@api.post(
    "/api/v2/admin/api-keys",
    body=ApiKeyCreate,
    response=ApiKeyCreated,
    status=201,
    role=Role.operator,
    summary="Create an A2A API key bound to one instance (shown once)",
    tag="api-keys",
)
async def create_api_key(call: Call[ApiKeyCreate, NoQuery]) -> ApiKeyCreated:
    svc = services(call.request)
    who = call.require_principal()
    body = call.body
    owner = await instance_owner(call.request, body.instance_id)
    if owner is None or not _can_use_instance(who, owner):
        raise not_found("instance", body.instance_id)
    try:
        issued = await svc.auth.create_api_key(
            instance_id=body.instance_id,
            owner=who.subject,
            scopes=frozenset(body.scopes),
            name=body.name,
            expires_at=(
                dt.datetime.now(dt.UTC) + dt.timedelta(seconds=body.expires_in_seconds)
                if body.expires_in_seconds
                else None
            ),
        )
    except LookupError:
        raise not_found("instance", body.instance_id) from None
    except ValueError as exc:
        raise ProblemError(
            422, str(exc), errors=[{"field": "body.scopes", "message": str(exc), "type": "value"}]
        ) from None
    row = await svc.auth.get_api_key(issued.id)
    assert row is not None
    svc.audit.record(
        who.actor, "apikey.create", "apikey", row.id, detail={"instance": row.instance_id}
    )
    return ApiKeyCreated(**ApiKeyInfo.model_validate(row).model_dump(), key=issued.secret)


@api.get(
    "/api/v2/admin/api-keys",
    query=ApiKeyQuery,
    response=ApiKeyList,
    role=Role.viewer,
    summary="List A2A API keys (yours, or all as admin)",
    tag="api-keys",
)
async def list_api_keys(call: Call[NoBody, ApiKeyQuery]) -> ApiKeyList:
    who = call.require_principal()
    rows = await services(call.request).auth.list_api_keys(
        owner=None if who.is_admin else who.subject, instance_id=call.query.instance_id
    )
    return ApiKeyList(items=[ApiKeyInfo.model_validate(r) for r in rows])


@api.delete(
    "/api/v2/admin/api-keys/{key_id}",
    role=Role.operator,
    summary="Revoke an A2A API key",
    tag="api-keys",
)
async def revoke_api_key(call: Call[NoBody, NoQuery]) -> None:
    svc = services(call.request)
    who = call.require_principal()
    key_id = call.match["key_id"]
    row = await svc.auth.get_api_key(key_id)
    if row is None or not who.can_see(row.owner):
        raise not_found("api-key", key_id)
    await svc.auth.revoke_api_key(key_id)
    svc.audit.record(who.actor, "apikey.revoke", "apikey", key_id)


async def instance_owner(request: web.Request, instance_id: str) -> str | None:
    live = await live_instance(request, instance_id)
    return None if live is None else live[0]


async def live_instance(request: web.Request, instance_id: str) -> tuple[str, str] | None:
    """(owner, incarnation) of a live instance, or None."""
    from agentic_sandbox.broker.store import models as m

    async with services(request).db.session() as s:
        row = await s.get(m.Instance, instance_id)
        return None if row is None or row.deleted_at is not None else (row.owner, row.incarnation)
