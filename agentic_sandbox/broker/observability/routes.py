"""Observability surface: `/metrics`, `/api/v1/events` (cursor + SSE), and the audit log."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

from aiohttp import web
from pydantic import Field, field_validator

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.config import MetricsAccess
from agentic_sandbox.broker.http.middleware import credential_still_valid
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, current_principal
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.http.sse import EventStream
from agentic_sandbox.broker.observability.event import EventFilter
from agentic_sandbox.broker.services import Services, services

CREDENTIAL_RECHECK_SECONDS = 2.0  # a follower's SSE re-reads its credential this often

api = ApiRoutes()

MAX_PAGE = 200


class EventsQuery(Input):
    after: int = Field(default=0, ge=0, le=2**63 - 1, description="return events with seq > after")
    limit: int = Field(default=100, ge=1, le=MAX_PAGE)
    type: list[str] | str | None = Field(
        default=None,
        description="event type or family prefix (e.g. `instance.*`); repeat or comma-separate",
    )
    instance_id: InstanceId | None = None
    session_id: str | None = Field(default=None, max_length=64)
    task_id: str | None = Field(default=None, max_length=64)
    host: str | None = Field(default=None, max_length=63)

    @field_validator("after", mode="before")
    @classmethod
    def _cursor(cls, value: object) -> object:
        if isinstance(value, str) and not value.isdigit():
            raise ValueError("cursor must be a non-negative integer seq")
        return value

    def types(self) -> tuple[str, ...]:
        raw = self.type
        if raw is None:
            return ()
        items = raw if isinstance(raw, list) else [raw]
        out: list[str] = []
        for item in items:
            out.extend(t.strip() for t in item.split(",") if t.strip())
        for t in out:
            if len(t) > 64 or not all(c.isalnum() or c in "._*-" for c in t):
                raise ProblemError(
                    400,
                    f"query.type: invalid event type filter {t!r}",
                    errors=[{"field": "query.type", "message": "invalid filter", "type": "value"}],
                )
        return tuple(out)

    def filter(self, owner: str | None) -> EventFilter:
        return EventFilter(
            owner=owner,
            types=self.types(),
            instance_id=self.instance_id,
            session_id=self.session_id,
            task_id=self.task_id,
            host=self.host,
        )


class StreamQuery(EventsQuery):
    limit: int = Field(default=MAX_PAGE, ge=1, le=MAX_PAGE, description="unused for streams")


class EventOut(Output):
    seq: int
    type: str
    time: dt.datetime
    actor: str | None = None
    instance_id: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    host: str | None = None
    correlation_id: str | None = None
    data: dict[str, Any]


class EventPage(Output):
    items: list[EventOut]
    next: int = Field(description="cursor for the next page: pass as `after`")
    last_seq: int = Field(description="the newest seq the server has published")


@api.get(
    "/api/v1/events",
    query=EventsQuery,
    response=EventPage,
    role=Role.viewer,
    summary="Events after a cursor (oldest first, at most 200)",
    tag="events",
    follower=True,  # the shared log; a follower's tail keeps it current
)
async def list_events(call: Call[NoBody, EventsQuery]) -> EventPage:
    svc = services(call.request)
    q = call.query
    newest = await svc.events.newest()
    if q.after > newest:
        raise ProblemError(
            400,
            f"query.after: cursor {q.after} is beyond the newest event ({newest})",
            code="invalid-cursor",
            errors=[{"field": "query.after", "message": "cursor beyond newest", "type": "value"}],
        )
    who = call.require_principal()
    items = await svc.events.query(
        q.after, q.limit, q.filter(None if who.is_admin else who.subject)
    )
    nxt = items[-1].seq if items else q.after
    if len(items) < q.limit:
        nxt = max(nxt, svc.events.last_seq)
    return EventPage(
        items=[EventOut.model_validate(ev.to_json()) for ev in items],
        next=nxt,
        last_seq=svc.events.last_seq,
    )


@api.get(
    "/api/v1/events/stream",
    query=StreamQuery,
    role=Role.viewer,
    content_type="text/event-stream",
    summary="Live events as Server-Sent Events; resumes after `Last-Event-ID` (or `after`)",
    description="Ends with an `event: revoked` frame when the credential that opened it is "
    "revoked (or expires).",
    tag="events",
    follower=True,  # a follower streams what its tail pulls from the leader's log
)
async def stream_events(call: Call[NoBody, StreamQuery]) -> web.StreamResponse:
    svc = services(call.request)
    request = call.request
    after = call.query.after
    last_id = request.headers.get("Last-Event-ID")
    if last_id is not None:
        if not last_id.isdigit():
            raise ProblemError(400, "Last-Event-ID must be an event seq", code="invalid-cursor")
        after = int(last_id)
    newest = await svc.events.newest()
    if after > newest:
        raise ProblemError(
            400,
            f"cursor {after} is beyond the newest event ({newest})",
            code="invalid-cursor",
        )
    who = call.require_principal()
    flt = call.query.filter(None if who.is_admin else who.subject)
    stream = await EventStream.open(request, who)
    gen = svc.events.follow(after, flt, svc.settings.sse_client_queue)
    watch = None
    if svc.events.standby:  # a revocation on the leader must end this node's stream too
        watch = asyncio.create_task(_watch_credential(request, svc, who.credential_keys))
    try:
        async for ev in stream.follow(gen):
            if ev.type == "stream.gap":
                svc.metrics.sse_gaps.inc()
                await stream.send(json.dumps(ev.to_json()), event="gap")
            else:
                await stream.send(json.dumps(ev.to_json()), event=ev.type, id=str(ev.seq))
        if stream.revoked:
            await stream.send(json.dumps({"reason": stream.reason}), event="revoked")
    except ConnectionError:
        pass  # the client left
    finally:
        if watch is not None:
            watch.cancel()
        await stream.close()
        await gen.aclose()
    return stream.response


async def _watch_credential(request: web.Request, svc: Services, keys: tuple[str, ...]) -> None:
    while True:
        await asyncio.sleep(CREDENTIAL_RECHECK_SECONDS)
        try:
            valid = await credential_still_valid(request)
        except Exception:  # the store is away: the stream's own reads will say so
            continue
        if not valid:
            for key in keys:
                svc.streams.revoke(key, "the credential was revoked or expired")
            return


# ---- audit ------------------------------------------------------------------------------------
class AuditQuery(Input):
    subject_type: str | None = Field(default=None, max_length=32)
    subject_id: str | None = Field(default=None, max_length=128)
    actor: str | None = Field(default=None, max_length=160)
    outcome: str | None = Field(default=None, pattern="^(ok|denied|failed)$")
    after: int = Field(default=0, ge=0, le=2**63 - 1)
    limit: int = Field(default=100, ge=1, le=1000)


class AuditOut(Output):
    id: int
    time: dt.datetime
    actor: str
    action: str
    subject_type: str
    subject_id: str
    outcome: str
    cause: str
    from_state: str | None
    to_state: str | None
    correlation_id: str | None
    detail: dict[str, Any]


class AuditPage(Output):
    items: list[AuditOut]
    next: int


@api.get(
    "/api/v2/admin/audit",
    query=AuditQuery,
    response=AuditPage,
    role=Role.admin,
    summary="Audit log entries by subject, actor or outcome",
    tag="audit",
    follower=True,
)
async def list_audit(call: Call[NoBody, AuditQuery]) -> AuditPage:
    q = call.query
    rows = await services(call.request).audit.query(
        subject_type=q.subject_type,
        subject_id=q.subject_id,
        actor=q.actor,
        outcome=q.outcome,
        after=q.after,
        limit=q.limit,
    )
    return AuditPage(
        items=[AuditOut.model_validate(r) for r in rows], next=rows[-1].id if rows else q.after
    )


# ---- metrics ----------------------------------------------------------------------------------
async def metrics_handler(request: web.Request) -> web.Response:
    svc = services(request)
    if svc.settings.metrics_access is MetricsAccess.token and current_principal(request) is None:
        raise ProblemError(
            401,
            "/metrics needs a token (or set SANDBOX_METRICS_ACCESS=listener for a separate "
            "loopback listener)",
            headers={"WWW-Authenticate": 'Bearer realm="agentic-sandbox"'},
        )
    if (
        svc.settings.metrics_access is MetricsAccess.listener
        and request.app.get(IS_METRICS_APP) is None
    ):
        raise ProblemError(404, "metrics are served on the separate metrics listener")
    return web.Response(
        body=svc.metrics.exposition(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


IS_METRICS_APP = web.AppKey("is_metrics_app", bool)


def install_metrics(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics_handler, name="metrics")


def metrics_app(svc: Services) -> web.Application:
    """The separate, anonymous, loopback-only metrics listener's app."""
    from agentic_sandbox.broker.services import SERVICES

    app = web.Application()
    app[SERVICES] = svc
    app[IS_METRICS_APP] = True
    app.router.add_get("/metrics", metrics_handler)
    return app


__all__ = ["api", "install_metrics", "metrics_app"]
