"""Anonymous discovery: the signed AgentCard and the JWKS of each instance.

    GET /agents/{instance_id}/.well-known/agent-card.json
    GET /agents/{instance_id}/.well-known/jwks.json

Both are cacheable (`ETag`, `Last-Modified`, `Cache-Control: public, max-age`) and answer
conditional requests with 304.
"""

from __future__ import annotations

import email.utils
import hashlib
import json

from aiohttp import web

from agentic_sandbox.broker.a2a.binding import HANDLER, INSTANCE_ID
from agentic_sandbox.broker.a2a.card import build_card
from agentic_sandbox.broker.http.health import VERSION
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.store import models as m


async def _instance(request: web.Request) -> m.Instance:
    iid = request.match_info["instance_id"]
    handler = request.app[HANDLER]
    instance = await handler.tasks.instance(iid) if INSTANCE_ID.match(iid) else None
    if instance is None:
        raise ProblemError(404, f"no agent {iid!r} here", code="agent-not-found")
    return instance


def _not_modified(request: web.Request, etag: str, last_modified: str) -> bool:
    inm = request.headers.get("If-None-Match")
    if inm is not None:
        tags = {t.strip().removeprefix("W/") for t in inm.split(",")}
        return "*" in tags or etag in tags
    ims = request.headers.get("If-Modified-Since")
    if ims:
        try:
            since = email.utils.parsedate_to_datetime(ims)
            modified = email.utils.parsedate_to_datetime(last_modified)
        except (TypeError, ValueError):
            return False
        return modified <= since
    return False


def _cached(request: web.Request, body: bytes, etag: str, last_modified: str) -> web.Response:
    max_age = services(request).settings.a2a_card_max_age_seconds
    headers = {
        "ETag": etag,
        "Last-Modified": last_modified,
        "Cache-Control": f"public, max-age={max_age}",
    }
    if _not_modified(request, etag, last_modified):
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type="application/json", headers=headers)


async def agent_card(request: web.Request) -> web.StreamResponse:
    instance = await _instance(request)
    handler = request.app[HANDLER]
    settings = services(request).settings
    profile = await handler.tasks.profile(instance)
    card = build_card(
        instance=instance,
        profile=profile,
        public_url=settings.effective_public_url,
        server_version=VERSION,
        files_root=settings.task_files_root,
    )
    digest = hashlib.sha256(json.dumps(card, sort_keys=True).encode()).hexdigest()
    signed = await handler.cards.signed(card, instance=instance, cache_key=(instance.id, digest))
    return _cached(request, signed.body, signed.etag, signed.last_modified)


async def jwks(request: web.Request) -> web.StreamResponse:
    instance = await _instance(request)
    handler = request.app[HANDLER]
    keys = await handler.cards.keys.jwks(instance.id)
    body = json.dumps(keys, separators=(",", ":")).encode()
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    return _cached(
        request, body, etag, email.utils.format_datetime(instance.created_at, usegmt=True)
    )
