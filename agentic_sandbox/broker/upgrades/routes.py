"""`/api/v2/admin/agent-bundles` (upload, list) and `/api/v2/admin/agent-rollouts` (start one).

Admins only: a bundle is code every agent it reaches runs as root in its guest.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.instances import OperationOut
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.upgrades.bundles import (
    MAX_UPLOAD,
    BundleRejected,
    BundleStore,
    StoredBundle,
)
from agentic_sandbox.broker.upgrades.models import BundleList, BundleOut, RolloutRequest
from agentic_sandbox.broker.upgrades.rollout import Rollouts

api = ApiRoutes()

BUNDLES_KEY: web.AppKey[BundleStore] = web.AppKey("agent_bundles")
ROLLOUTS_KEY: web.AppKey[Rollouts] = web.AppKey("agent_rollouts")


def _out(b: StoredBundle) -> BundleOut:
    return BundleOut(
        digest=b.digest,
        version=b.version,
        size=b.size,
        builtin=b.builtin,
        created_by=b.created_by,
        created_at=b.created_at,
    )


async def _read_bundle(request: web.Request) -> bytes:
    """The raw body, at most `MAX_UPLOAD` bytes, within the body timeout (413/408 otherwise)."""
    announced = request.content_length
    if announced is not None and announced > MAX_UPLOAD:
        raise ProblemError(
            413,
            f"body: a bundle is at most {MAX_UPLOAD} bytes",
            code="payload-too-large",
            close=True,
        )
    seconds = services(request).settings.http_body_timeout_seconds
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.content.iter_chunked(256 * 1024):
                size += len(chunk)
                if size > MAX_UPLOAD:
                    raise ProblemError(
                        413,
                        f"body: a bundle is at most {MAX_UPLOAD} bytes",
                        code="payload-too-large",
                        close=True,
                    )
                parts.append(chunk)
    except TimeoutError:
        raise ProblemError(
            408,
            f"the request body did not arrive within {seconds:g}s",
            code="body-timeout",
            close=True,
        ) from None
    return b"".join(parts)


@api.post(
    "/api/v2/admin/agent-bundles",
    response=BundleOut,
    status=201,
    role=Role.admin,
    summary="Upload an agent bundle (a gzipped tar as `provision` builds it)",
    tag="upgrades",
    responses={
        200: "the bundle was uploaded before (the same SHA-256)",
        413: f"over {MAX_UPLOAD} bytes",
        422: "not a bundle an agent could run (why, in the errors)",
    },
)
async def upload_bundle(call: Call[NoBody, NoQuery]) -> BundleOut:
    """The body is the bundle itself. It is kept when a clean interpreter can import the
    agent from it and its `MANIFEST` names a version; its SHA-256 is its name."""
    who = call.require_principal()
    data = await _read_bundle(call.request)
    try:
        bundle, new = await call.app[BUNDLES_KEY].add(data, who.actor)
    except BundleRejected as exc:
        raise ProblemError(
            422,
            f"body: not an agent bundle: {exc}",
            code="invalid-input",
            errors=[{"field": "body", "message": str(exc), "type": "bundle"}],
        ) from None
    if new:
        services(call.request).audit.record(
            who.actor,
            "agent.bundle.upload",
            "agent_bundle",
            bundle.digest,
            detail={"version": bundle.version, "size": bundle.size},
        )
    else:
        call.status = 200
    return _out(bundle)


@api.get(
    "/api/v2/admin/agent-bundles",
    response=BundleList,
    role=Role.admin,
    summary="List the agent bundles: the server's own first, then the uploaded ones",
    tag="upgrades",
)
async def list_bundles(call: Call[NoBody, NoQuery]) -> BundleList:
    return BundleList(items=[_out(b) for b in await call.app[BUNDLES_KEY].all()])


@api.post(
    "/api/v2/admin/agent-rollouts",
    body=RolloutRequest,
    response=OperationOut,
    status=202,
    role=Role.admin,
    summary="Roll an agent bundle out to running instances, one at a time",
    tag="upgrades",
    responses={404: "no such bundle, or no such instance"},
)
async def start_rollout(call: Call[RolloutRequest, NoQuery]) -> OperationOut:
    """An operation (`agent-rollout`): each instance in turn gets the bundle over its agent
    link; its session keeper starts a worker on it and keeps it only when that worker links
    and hears the server within `trial_seconds`, else goes back to the bundle it ran. The
    server keeps an instance `upgraded` only when the new worker holds every session the old
    one did. The first instance not upgraded stops the rollout; the operation's result lists
    each instance's outcome (`upgraded`, `skipped` with why, `rolled-back`, `failed`)."""
    who = call.require_principal()
    req = call.body
    store = call.app[BUNDLES_KEY]
    bundle = await (store.get(req.bundle) if req.bundle else store.builtin())
    if bundle is None:
        raise ProblemError(404, f"body.bundle: no agent bundle {req.bundle}", code="not-found")
    if req.instances:
        await _check_instances(call, req.instances)
    op = await call.app[ROLLOUTS_KEY].start(
        bundle, req.instances, req.trial_seconds, owner=who.subject, actor=who.actor
    )
    return OperationOut.model_validate(op)


async def _check_instances(call: Call[RolloutRequest, NoQuery], ids: list[str]) -> None:
    if len(set(ids)) != len(ids):
        raise ProblemError(422, "body.instances: an instance is named twice", code="invalid-input")
    async with services(call.request).db.session() as s:
        found = set(
            (
                await s.scalars(
                    select(m.Instance.id).where(
                        m.Instance.id.in_(ids), m.Instance.deleted_at.is_(None)
                    )
                )
            ).all()
        )
    for iid in ids:
        if iid not in found:
            raise ProblemError(404, f"body.instances: no instance {iid}", code="not-found")
