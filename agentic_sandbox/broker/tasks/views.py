"""What the v1 task API and the admin missions roll-up share: the `Mission` model, the caller
of a request, and reading a page of tasks or one task with their problems (400 for a cursor
the server did not hand out, 404 for a task the caller may not see)."""

from __future__ import annotations

import datetime as dt

from pydantic import Field

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.http.problems import ProblemError, not_found
from agentic_sandbox.broker.http.schemas import Output
from agentic_sandbox.broker.tasks.errors import InvalidTaskInput, TaskNotFound
from agentic_sandbox.broker.tasks.record import TaskRecord
from agentic_sandbox.broker.tasks.service import Caller, TaskService
from agentic_sandbox.broker.tasks.store import TaskFilter


class Mission(Output):
    """A task as the admin surface and the v1 API show it (`mission` is its legacy name)."""

    id: str
    instance_id: str
    owner: str
    context_id: str
    state: str = Field(
        description="submitted, working, input-required, auth-required, "
        "completed, failed, canceled or rejected"
    )
    skill: str | None
    session_id: str | None = Field(description="the run's PTY session (attachable live)")
    exit_code: int | None
    status_message: str | None = Field(description="why the task is in its state")
    created_at: dt.datetime
    updated_at: dt.datetime
    status_at: dt.datetime


def mission(rec: TaskRecord) -> Mission:
    msg = rec.status_message
    text = None
    if msg:
        text = "\n".join(p.get("text", "") for p in msg.get("parts", []) if "text" in p) or None
    exit_code = rec.metadata.get("exitCode")
    return Mission(
        id=rec.id,
        instance_id=rec.instance_id,
        owner=rec.owner,
        context_id=rec.context_id,
        state=rec.state.value,
        skill=rec.skill,
        session_id=rec.metadata.get("sessionId"),
        exit_code=exit_code if isinstance(exit_code, int) else None,
        status_message=text,
        created_at=rec.created_at,
        updated_at=rec.updated_at,
        status_at=rec.status_at,
    )


def caller_of(principal: Principal) -> Caller:
    if principal.kind == "apikey":
        raise ProblemError(
            403,
            "A2A API keys work on the A2A surface (/agents/{instance_id}) only; "
            "use an operator token here",
            code="forbidden-credential",
        )
    return Caller(subject=principal.subject, actor=principal.actor, is_admin=principal.is_admin)


async def list_page(
    tasks: TaskService, flt: TaskFilter, *, limit: int, cursor: str | None
) -> tuple[list[TaskRecord], str | None]:
    """One page of tasks and the cursor of the next (None on the last page)."""
    try:
        records, page = await tasks.list_tasks(flt, page_size=limit, page_token=cursor or "")
    except InvalidTaskInput as exc:
        raise ProblemError(
            400,
            "query.cursor: not a cursor this server handed out",
            code="invalid-cursor",
            errors=[{"field": "query.cursor", "message": exc.message, "type": "value"}],
        ) from None
    return records, page.next_token or None


async def visible_task(tasks: TaskService, task_id: str, caller: Caller, noun: str) -> TaskRecord:
    """The task if the caller may see it, else 404 naming it as `noun` (task, mission)."""
    try:
        return await tasks.get(task_id, caller)
    except TaskNotFound:
        raise not_found(noun, task_id) from None
