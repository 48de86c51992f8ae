"""The deprecated v1 task API (`/api/v1/tasks`), kept for old clients, on the same task store.

Every response (errors and streams included) carries `Deprecation`, `Sunset` and `Link`
headers pointing at the A2A surface that replaces it. Differences from A2A: a submit over
the pending bound is refused with 429 + Retry-After instead of a rejected task.
"""

from __future__ import annotations

import calendar
import datetime as dt
import email.utils
import json
import uuid
from typing import Any

from aiohttp import web
from pydantic import Field, model_validator

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.problems import ProblemError, not_found, too_many, unprocessable
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output
from agentic_sandbox.broker.http.sse import EventStream
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.sessions import BudgetIn
from agentic_sandbox.broker.tasks.errors import (
    IdempotencyConflict,
    InvalidTaskInput,
    QuotaExceeded,
    TaskError,
    TaskNotCancelable,
    TaskNotFound,
    UnsupportedContent,
)
from agentic_sandbox.broker.tasks.keys import TASKS
from agentic_sandbox.broker.tasks.states import TaskState
from agentic_sandbox.broker.tasks.store import TaskFilter
from agentic_sandbox.broker.tasks.views import Mission, caller_of, list_page, mission, visible_task

api = ApiRoutes()

PREFIX = "/api/v1/tasks"
DEPRECATED_AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class V1TaskSubmit(Input):
    instance_id: InstanceId
    command: str | None = Field(
        default=None, min_length=1, max_length=100_000, description="a bash command line"
    )
    skill: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", description="skill id"
    )
    data: dict[str, Any] | list[Any] | None = Field(
        default=None, description="input for the skill (checked against its JSON Schema)"
    )
    budget: BudgetIn | None = Field(
        default=None,
        description="what the run may use, within the loadout's defaults and ceilings",
    )
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=128, description="same key, same task"
    )

    @model_validator(mode="after")
    def _something(self) -> V1TaskSubmit:
        if self.command is None and self.data is None:
            raise ValueError("give a command, or data for a skill")
        return self


class V1Task(Mission):
    output: str | None = Field(default=None, description="terminal output so far (GET by id)")


class V1TaskList(Output):
    items: list[V1Task]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page")


class V1ListQuery(Input):
    instance_id: InstanceId | None = None
    state: TaskState | None = None
    limit: int = Field(default=50, ge=1, le=200)
    cursor: str | None = Field(default=None, max_length=400)


def deprecation_headers(request: web.Request, response: web.StreamResponse) -> None:
    if not request.path.startswith(PREFIX):
        return
    settings = services(request).settings
    sunset = dt.datetime.combine(settings.v1_sunset, dt.time(23, 59, 59), tzinfo=dt.UTC)
    response.headers["Deprecation"] = f"@{calendar.timegm(DEPRECATED_AT.utctimetuple())}"
    response.headers["Sunset"] = email.utils.format_datetime(sunset, usegmt=True)
    base = settings.effective_public_url
    links = [f'<{base}/api/openapi.json>; rel="deprecation"; type="application/json"']
    successor = request.get(SUCCESSOR)
    if successor:
        links.append(f'<{base}{successor}>; rel="successor-version"')
    response.headers["Link"] = ", ".join(links)


SUCCESSOR = web.RequestKey("v1_successor", str)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    deprecation_headers(request, response)


def _successor(call: Call[Any, Any], instance_id: str) -> None:
    call.request[SUCCESSOR] = f"/agents/{instance_id}/.well-known/agent-card.json"


def _problem(exc: TaskError) -> ProblemError:
    if isinstance(exc, QuotaExceeded):
        return too_many(exc.message, exc.retry_after)
    if isinstance(exc, IdempotencyConflict):
        return ProblemError(409, exc.message, code="idempotency-conflict")
    if isinstance(exc, TaskNotCancelable):
        return ProblemError(409, exc.message, code="task-not-cancelable")
    if isinstance(exc, InvalidTaskInput | UnsupportedContent):
        field = f"body.{exc.field.removeprefix('metadata.')}" if exc.field else "body"
        return unprocessable(
            exc.message, [{"field": field, "message": exc.message, "type": "value"}]
        )
    return ProblemError(409, exc.message)


@api.post(
    PREFIX,
    body=V1TaskSubmit,
    response=V1Task,
    status=201,
    role=Role.operator,
    summary="Submit a task (deprecated: use A2A SendMessage)",
    tag="v1-tasks",
    deprecated=True,
    responses={429: "too many tasks are waiting; retry after Retry-After seconds"},
)
async def submit_task(call: Call[V1TaskSubmit, NoQuery]) -> V1Task:
    tasks = call.app[TASKS]
    caller = caller_of(call.require_principal())
    body = call.body
    _successor(call, body.instance_id)
    parts: list[dict[str, Any]] = []
    if body.command is not None:
        parts.append({"text": body.command})
    if body.data is not None:
        parts.append({"data": body.data})
    message: dict[str, Any] = {
        "messageId": body.idempotency_key or f"v1-{uuid.uuid4()}",
        "role": "ROLE_USER",
        "parts": parts,
    }
    meta: dict[str, Any] = {}
    if body.skill:
        meta["skillId"] = body.skill
    if body.budget is not None:
        meta["budget"] = body.budget.model_dump(exclude_none=True)
    if meta:
        message["metadata"] = meta
    try:
        rec = await tasks.submit(
            instance_id=body.instance_id, caller=caller, message=message, refuse_over_quota=True
        )
    except TaskNotFound:
        raise not_found("instance", body.instance_id) from None
    except TaskError as exc:
        raise _problem(exc) from None
    return V1Task(**mission(rec).model_dump())


@api.get(
    PREFIX,
    query=V1ListQuery,
    response=V1TaskList,
    role=Role.viewer,
    summary="List tasks, newest activity first (deprecated: use A2A ListTasks)",
    tag="v1-tasks",
    deprecated=True,
)
async def list_tasks(call: Call[NoBody, V1ListQuery]) -> V1TaskList:
    tasks = call.app[TASKS]
    caller = caller_of(call.require_principal())
    q = call.query
    flt = TaskFilter(
        instance_id=q.instance_id,
        owner=None if caller.is_admin else caller.subject,
        states=(q.state,) if q.state else (),
    )
    records, next_cursor = await list_page(tasks, flt, limit=q.limit, cursor=q.cursor)
    return V1TaskList(
        items=[V1Task(**mission(r).model_dump()) for r in records], next_cursor=next_cursor
    )


@api.get(
    PREFIX + "/{task_id}",
    response=V1Task,
    role=Role.viewer,
    summary="One task with its output so far (deprecated: use A2A GetTask)",
    tag="v1-tasks",
    deprecated=True,
)
async def get_task(call: Call[NoBody, NoQuery]) -> V1Task:
    tasks = call.app[TASKS]
    caller = caller_of(call.require_principal())
    rec = await visible_task(tasks, call.match["task_id"], caller, "task")
    _successor(call, rec.instance_id)
    return V1Task(**mission(rec).model_dump(), output=rec.output_text())


@api.delete(
    PREFIX + "/{task_id}",
    response=V1Task,
    role=Role.operator,
    summary="Cancel a task: TERM, then KILL after the grace period (deprecated: CancelTask)",
    tag="v1-tasks",
    deprecated=True,
    responses={409: "the task already ended"},
)
async def cancel_task(call: Call[NoBody, NoQuery]) -> V1Task:
    tasks = call.app[TASKS]
    caller = caller_of(call.require_principal())
    task_id = call.match["task_id"]
    try:
        rec = await tasks.cancel(task_id, caller)
    except TaskNotFound:
        raise not_found("task", task_id) from None
    except TaskError as exc:
        raise _problem(exc) from None
    _successor(call, rec.instance_id)
    return V1Task(**mission(rec).model_dump())


@api.get(
    PREFIX + "/{task_id}/logs",
    role=Role.viewer,
    content_type="text/event-stream",
    summary="The task's output as Server-Sent Events: what exists, then live, until it ends "
    "(deprecated: use A2A SubscribeToTask)",
    tag="v1-tasks",
    deprecated=True,
)
async def task_logs(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    tasks = call.app[TASKS]
    caller = caller_of(call.require_principal())
    task_id = call.match["task_id"]
    settings = services(call.request).settings
    try:
        stream = await tasks.open_stream(task_id, caller, queue=settings.sse_client_queue)
    except TaskNotFound:
        raise not_found("task", task_id) from None
    _successor(call, stream.snapshot.instance_id)
    try:
        out = await EventStream.open(call.request, call.require_principal(), retry_ms=None)
    except BaseException:
        stream.close()
        raise

    async def send(event: str, data: dict[str, Any]) -> None:
        await out.send(json.dumps(data), event=event)

    try:
        snap = stream.snapshot
        text = snap.output_text()
        if text:
            await send("output", {"text": text})
        await send("state", {"state": snap.state.value})
        async for ev in out.follow(stream.events()):
            if "artifactUpdate" in ev:
                for part in ev["artifactUpdate"]["artifact"]["parts"]:
                    if part.get("text"):
                        await send("output", {"text": part["text"]})
            elif "statusUpdate" in ev:
                state = TaskState.from_wire(ev["statusUpdate"]["status"]["state"])
                await send("state", {"state": state.value})
            elif "task" in ev:  # resync after falling behind
                await send(
                    "state", {"state": TaskState.from_wire(ev["task"]["status"]["state"]).value}
                )
        if out.revoked:
            await send("revoked", {"reason": out.reason})
        else:
            final = await tasks.get(task_id, caller)
            await send(
                "end", {"state": final.state.value, "exit_code": final.metadata.get("exitCode")}
            )
    except ConnectionError:
        pass  # the client left
    finally:
        await out.close()
        stream.close()
    return out.response


__all__ = ["api", "on_prepare"]
