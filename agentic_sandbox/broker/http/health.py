"""Health probes and the OpenAPI document."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.openapi import build_openapi
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery, route_specs
from agentic_sandbox.broker.http.schemas import Output
from agentic_sandbox.broker.services import services

api = ApiRoutes()

CHECK_TIMEOUT = 3.0
VERSION = "0.1.0"


class Health(Output):
    status: str
    server_id: str
    version: str


class ReadyCheck(Output):
    ok: bool
    detail: str | None = Field(
        default=None, description="why (for callers with an operator token or cookie only)"
    )


class LeaderOut(Output):
    node: str
    url: str


class Ready(Output):
    status: str
    checks: dict[str, ReadyCheck]
    role: str = Field(description="leader | follower | single-node (SQLite: one server)")
    node: str = Field(description="this node's name (SANDBOX_NODE_NAME)")
    term: int | None = Field(default=None, description="the leader's term (PostgreSQL only)")
    leader: LeaderOut | None = Field(
        default=None, description="who leads (a follower sends writes there); null: nobody yet"
    )


@api.get(
    "/healthz",
    response=Health,
    role=None,
    summary="The process is alive",
    tag="health",
    follower=True,
)
async def healthz(call: Call[NoBody, NoQuery]) -> Health:
    svc = services(call.request)
    return Health(status="ok", server_id=svc.server_id, version=VERSION)


@api.get(
    "/readyz",
    response=Ready,
    role=None,
    summary="Ready to serve: database reachable, storage writable, libvirt reachable when "
    "configured",
    description="Anonymous callers get the status and which checks pass; the details (URIs, "
    "counts, errors) are for callers with an operator token or the dashboard cookie.",
    tag="health",
    responses={503: "not ready; `checks` says which dependency (and, authenticated, why)"},
    follower=True,
)
async def readyz(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    svc = services(call.request)
    detailed = call.principal is not None and call.principal.kind != "apikey"

    async def db_check() -> tuple[bool, str]:
        await svc.db.ping()
        return True, svc.db.dialect

    checks = {"database": db_check, **svc.readiness}
    results: dict[str, ReadyCheck] = {}
    for name, check in checks.items():
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                ok, detail = await check()
        except TimeoutError:
            ok, detail = False, f"no answer within {CHECK_TIMEOUT:.0f}s"
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results[name] = ReadyCheck(ok=ok, detail=detail if detailed else None)
    ready = all(r.ok for r in results.values())
    cluster = svc.cluster
    leader = cluster.leader if cluster is not None else None
    body = Ready(
        status="ready" if ready else "not-ready",
        checks=results,
        role=cluster.role.value if cluster is not None else "single-node",
        node=svc.settings.node_name,
        term=cluster.term if cluster is not None else None,
        leader=LeaderOut(node=leader.node, url=leader.url) if leader is not None else None,
    )
    doc = body.model_dump(mode="json", exclude_none=True)
    doc.setdefault("leader", None)  # always present: null says nobody leads
    return web.json_response(doc, status=200 if ready else 503)


@api.get(
    "/api/openapi.json",
    role=Role.viewer,
    content_type="application/json",
    summary="This OpenAPI 3.1 document",
    tag="meta",
    follower=True,
)
async def openapi_doc(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    svc = services(call.request)
    specs = [s for s in route_specs(call.request.app) if s.path.startswith("/api/")]
    doc = build_openapi(
        specs,
        title="agentic-sandbox",
        version=VERSION,
        server_url=svc.settings.effective_public_url,
    )
    return web.Response(text=json.dumps(doc), content_type="application/json")
