"""Admin routes for sessions: create, list, get, kill, signal, screen, recording.

(The attach WebSocket is in attach.py.)
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field, StringConstraints, field_validator
from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.http.problems import ProblemError, not_found, not_ready, too_many
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import (
    EnvName,
    Input,
    InstanceId,
    Output,
    nul_free_values,
)
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.sessions import budgets
from agentic_sandbox.broker.sessions.access import require_visible
from agentic_sandbox.broker.sessions.budgets import BudgetIn
from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    SessionEnded,
    SessionError,
    SessionNotFound,
    SessionSpec,
)
from agentic_sandbox.broker.sessions.hub import (
    HUB_KEY,
    HubSession,
    SessionHub,
    SessionOpenTimeout,
    SessionStartFailed,
    TooManySessions,
)
from agentic_sandbox.broker.sessions.screen import scrollback_tail
from agentic_sandbox.broker.store import models as m

api = ApiRoutes()

Arg = Annotated[str, StringConstraints(max_length=8192)]


def hub_of(request: web.Request) -> SessionHub:
    return request.app[HUB_KEY]


class SessionCreate(Input):
    instance_id: InstanceId
    command: list[Arg] | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="argv to run; omit for the user's login shell",
    )
    cols: int = Field(default=80, ge=1, le=1000)
    rows: int = Field(default=24, ge=1, le=500)
    env: dict[EnvName, Annotated[str, StringConstraints(max_length=32768)]] = Field(
        default_factory=dict, max_length=256
    )
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    user: str | None = Field(default=None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    name: str = Field(default="", max_length=128)
    budget: BudgetIn = Field(
        default_factory=BudgetIn,
        description="what the session may use, within the loadout's defaults and ceilings "
        "(a wall-clock timeout only when asked); an exceeded budget ends the session with the "
        "reason in its session.* event",
    )

    @field_validator("cwd")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or "\x00" in value):
            raise ValueError("must be an absolute path")
        return value

    @field_validator("command")
    @classmethod
    def _no_nul(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (any("\x00" in a for a in value) or not value[0]):
            raise ValueError("arguments must be non-empty text without NUL bytes")
        return value

    @field_validator("env")
    @classmethod
    def _no_nul_env(cls, value: dict[str, str]) -> dict[str, str]:
        return nul_free_values(value)


class OutputRange(Output):
    start: int = Field(description="oldest offset the server still holds")
    end: int = Field(description="total output bytes so far")


class Member(Output):
    id: str
    subject: str
    role: str


class SessionInfo(Output):
    id: str
    instance_id: str
    owner: str
    name: str
    command: list[str] | None
    cols: int
    rows: int
    cwd: str | None
    user: str | None
    state: str
    task_id: str | None
    exit_code: int | None
    exit_signal: str | None
    exit_reason: str
    created_at: dt.datetime
    ended_at: dt.datetime | None
    output: OutputRange
    held: bool = Field(description="the server holds it (attachable); false once evicted")
    agent_connected: bool
    controller: str | None
    observers: int
    members: list[Member]
    recording: bool


class SessionList(Output):
    items: list[SessionInfo]


class SessionListQuery(Input):
    instance_id: InstanceId | None = None
    state: Literal["starting", "running", "killing", "exited", "failed", "lost"] | None = None
    task_id: str | None = Field(default=None, max_length=36)
    limit: int = Field(default=100, ge=1, le=1000)


class SignalBody(Input):
    signal: Literal["INT", "TERM", "KILL", "HUP"]


class ScreenQuery(Input):
    scrollback: int = Field(default=100, ge=0, le=5000, description="lines above the screen")


class Cursor(Output):
    x: int
    y: int
    hidden: bool


class ScreenInfo(Output):
    session_id: str
    cols: int
    rows: int
    cursor: Cursor
    lines: list[str] = Field(description="the visible screen, one string per row")
    text: str = Field(description="the visible screen as text (trailing blanks trimmed)")
    scrollback: list[str] = Field(description="recent lines above the screen (from output)")
    offset: int = Field(description="the output offset the screen reflects")


def _info(hub: SessionHub, row: m.Session, live: HubSession | None) -> SessionInfo:
    if live is not None:
        exit_ = live.exit
        return SessionInfo(
            id=live.id,
            instance_id=live.instance_id,
            owner=live.owner,
            name=live.name,
            command=live.command,
            cols=live.cols,
            rows=live.rows,
            cwd=live.cwd,
            user=live.user,
            state=live.state.value,
            task_id=live.task_id,
            exit_code=exit_.code if exit_ else None,
            exit_signal=exit_.signal if exit_ else None,
            exit_reason=exit_.reason if exit_ else "",
            created_at=live.created_at,
            ended_at=live.ended_at or row.ended_at,
            output=OutputRange(start=live.ring.start, end=live.ring.end),
            held=True,
            agent_connected=hub.agent_ready(live.instance_id),
            controller=live.controller.subject if live.controller else None,
            observers=live.observers(),
            members=[Member(**mm) for mm in live.members()],
            recording=bool(live.recording_path),
        )
    return SessionInfo(
        id=row.id,
        instance_id=row.instance_id,
        owner=row.owner,
        name=row.name,
        command=list(row.command) if row.command else None,
        cols=row.cols,
        rows=row.rows,
        cwd=row.cwd,
        user=row.user,
        state=row.state,
        task_id=row.task_id,
        exit_code=row.exit_code,
        exit_signal=row.exit_signal,
        exit_reason=row.exit_reason,
        created_at=row.created_at,
        ended_at=row.ended_at,
        output=OutputRange(start=row.output_offset, end=row.output_offset),
        held=False,
        agent_connected=hub.agent_ready(row.instance_id),
        controller=None,
        observers=0,
        members=[],
        recording=bool(row.recording_path),
    )


async def _load(call: Call[Any, Any], who: Principal) -> tuple[m.Session, bool]:
    """The session row (404 unless visible) and whether the caller may control it."""
    svc = services(call.request)
    session_id = call.match["session_id"]
    async with svc.db.session() as s:
        row = await s.get(m.Session, session_id)
    if row is None:
        raise not_found("session", session_id)
    control = await require_visible(
        svc.db, who, session_id=row.id, owner=row.owner, instance_id=row.instance_id
    )
    return row, control


def _problem(exc: SessionError) -> ProblemError:
    if isinstance(exc, AgentUnavailable):
        return not_ready(str(exc) or "the instance's agent is not connected")
    if isinstance(exc, TooManySessions):
        return too_many(str(exc), 30)
    if isinstance(exc, SessionStartFailed):
        return ProblemError(422, str(exc), code="session-start-failed")
    if isinstance(exc, SessionOpenTimeout):
        return ProblemError(504, str(exc), code="agent-timeout")
    if isinstance(exc, SessionEnded):
        return ProblemError(409, "the session has ended", code="session-ended")
    if isinstance(exc, SessionNotFound):
        return ProblemError(
            409, "the session is no longer held by this server", code="session-gone"
        )
    return ProblemError(502, str(exc), code="agent-error")


@api.post(
    "/api/v2/admin/sessions",
    body=SessionCreate,
    response=SessionInfo,
    status=201,
    role=Role.operator,
    summary="Open a PTY session on an instance's agent",
    tag="sessions",
    responses={
        503: "the instance's agent is not connected",
        429: "too many sessions",
        422: "a budget field over the loadout's ceiling, or one the agent cannot enforce",
    },
)
async def create_session(call: Call[SessionCreate, NoQuery]) -> SessionInfo:
    svc = services(call.request)
    who = call.require_principal()
    if who.kind == "apikey":
        raise ProblemError(
            403, "A2A API keys cannot use the admin session routes", code="forbidden-key"
        )
    body = call.body
    async with svc.db.session() as s:
        inst = await s.get(m.Instance, body.instance_id)
    if inst is None or inst.deleted_at is not None or not who.can_see(inst.owner):
        raise not_found("instance", body.instance_id)
    hub = hub_of(call.request)
    budget = budgets.resolve(
        body.budget, await budgets.loadout_budgets(svc.db, inst), interactive=True
    )
    support = hub.budget_support(body.instance_id)
    if budget.limited and support is not None:
        budgets.check_support(
            budget, support.enforcement, support.budgets, support.problem, body.instance_id
        )
    try:
        sid = await hub.create(
            SessionSpec(
                instance_id=body.instance_id,
                owner=who.subject,
                command=body.command,
                cols=body.cols,
                rows=body.rows,
                env=dict(body.env),
                cwd=body.cwd,
                user=body.user,
                name=body.name,
                budget=budgets.agent_spec(budget),
            ),
            actor=who.actor,
        )
    except SessionError as exc:
        raise _problem(exc) from None
    async with svc.db.session() as s:
        row = await s.get(m.Session, sid)
    assert row is not None
    return _info(hub, row, hub.get(sid))


@api.get(
    "/api/v2/admin/sessions",
    query=SessionListQuery,
    response=SessionList,
    role=Role.viewer,
    summary="List sessions you can see (newest first)",
    tag="sessions",
)
async def list_sessions(call: Call[NoBody, SessionListQuery]) -> SessionList:
    svc = services(call.request)
    who = call.require_principal()
    q = call.query
    stmt = select(m.Session).order_by(m.Session.created_at.desc()).limit(q.limit)
    if not who.is_admin:
        shared = select(m.Share.object_id).where(
            m.Share.subject == who.subject, m.Share.object_type == "session"
        )
        shared_inst = select(m.Share.object_id).where(
            m.Share.subject == who.subject, m.Share.object_type == "instance"
        )
        stmt = stmt.where(
            (m.Session.owner == who.subject)
            | m.Session.id.in_(shared)
            | m.Session.instance_id.in_(shared_inst)
        )
    if q.instance_id:
        stmt = stmt.where(m.Session.instance_id == q.instance_id)
    if q.state:
        stmt = stmt.where(m.Session.state == q.state)
    if q.task_id:
        stmt = stmt.where(m.Session.task_id == q.task_id)
    async with svc.db.session() as s:
        rows = (await s.scalars(stmt)).all()
    hub = hub_of(call.request)
    return SessionList(items=[_info(hub, r, hub.get(r.id)) for r in rows])


@api.get(
    "/api/v2/admin/sessions/{session_id}",
    response=SessionInfo,
    role=Role.viewer,
    summary="One session: state, output offsets, controller and members",
    tag="sessions",
)
async def get_session(call: Call[NoBody, NoQuery]) -> SessionInfo:
    who = call.require_principal()
    row, _ = await _load(call, who)
    hub = hub_of(call.request)
    return _info(hub, row, hub.get(row.id))


def _require_control(control: bool) -> None:
    if not control:
        raise ProblemError(
            403, "only the owner (operator role) or an admin may do this", code="forbidden"
        )


@api.post(
    "/api/v2/admin/sessions/{session_id}/kill",
    response=SessionInfo,
    status=202,
    role=Role.operator,
    summary="End a session (HUP to its process group, then KILL after a grace period)",
    tag="sessions",
)
async def kill_session(call: Call[NoBody, NoQuery]) -> SessionInfo:
    who = call.require_principal()
    row, control = await _load(call, who)
    _require_control(control)
    hub = hub_of(call.request)
    live = hub.get(row.id)
    if live is not None:
        try:
            await hub.kill(row.id, actor=who.actor)
        except SessionError as exc:
            raise _problem(exc) from None
    return _info(hub, row, hub.get(row.id))


@api.post(
    "/api/v2/admin/sessions/{session_id}/signal",
    body=SignalBody,
    response=SessionInfo,
    status=202,
    role=Role.operator,
    summary="Send INT, TERM, KILL or HUP to the session's foreground process group",
    tag="sessions",
)
async def signal_session(call: Call[SignalBody, NoQuery]) -> SessionInfo:
    who = call.require_principal()
    row, control = await _load(call, who)
    _require_control(control)
    hub = hub_of(call.request)
    try:
        await hub.signal(row.id, call.body.signal, actor=who.actor)
    except SessionError as exc:
        raise _problem(exc) from None
    return _info(hub, row, hub.get(row.id))


@api.get(
    "/api/v2/admin/sessions/{session_id}/screen",
    query=ScreenQuery,
    response=ScreenInfo,
    role=Role.viewer,
    summary="The session's current screen (rows, cols, cursor, text) and a scrollback tail",
    tag="sessions",
    responses={409: "the session is no longer held by this server"},
)
async def get_screen(call: Call[NoBody, ScreenQuery]) -> ScreenInfo:
    who = call.require_principal()
    row, _ = await _load(call, who)
    hub = hub_of(call.request)
    live = hub.get(row.id)
    if live is None:
        raise _problem(SessionNotFound(row.id))
    screen = hub.screen(live)
    lines = screen.lines()
    return ScreenInfo(
        session_id=live.id,
        cols=screen.cols,
        rows=screen.rows,
        cursor=Cursor(**screen.cursor()),
        lines=lines,
        text="\n".join(lines).rstrip("\n"),
        scrollback=scrollback_tail(live.ring, screen.rows, call.query.scrollback),
        offset=screen.offset,
    )


@api.get(
    "/api/v2/admin/sessions/{session_id}/recording",
    role=Role.viewer,
    content_type="application/x-asciicast",
    summary="Download the session's recording (asciicast v2)",
    tag="sessions",
)
async def get_recording(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    who = call.require_principal()
    row, _ = await _load(call, who)
    hub = hub_of(call.request)
    live = hub.get(row.id)
    if live is not None and live.recording is not None:
        live.recording.flush()
    if not row.recording_path:
        raise ProblemError(404, "this session has no recording", code="recording-not-found")
    path = hub.recording_file(row.id)  # derived from the id, never the stored path
    if path is None or not await asyncio.to_thread(path.is_file):
        raise ProblemError(404, "the recording file is gone", code="recording-not-found")
    return web.FileResponse(
        path,
        headers={
            "Content-Type": "application/x-asciicast",
            "Content-Disposition": f'attachment; filename="{row.id}.cast"',
            "Cache-Control": "no-store",
        },
    )
