"""Admin roll-up of tasks across instances: `/api/v2/admin/missions`.

Operators see their own tasks, admins everyone's; filters by instance, owner and state, with
totals per state for the same filters and a cursor for the next page. One mission shows its
runs and its audited state transitions.
"""

from __future__ import annotations

import datetime as dt

from pydantic import Field, field_validator

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output, SubjectName
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.tasks.keys import TASKS
from agentic_sandbox.broker.tasks.states import TaskState
from agentic_sandbox.broker.tasks.store import TaskFilter
from agentic_sandbox.broker.tasks.views import Mission, caller_of, list_page, mission, visible_task

api = ApiRoutes()


class MissionQuery(Input):
    instance_id: InstanceId | None = None
    owner: SubjectName | None = Field(default=None, description="admins only")
    state: list[TaskState] | None = Field(
        default=None, description="one or more states (repeat, or comma-separate)"
    )
    limit: int = Field(default=50, ge=1, le=500)
    cursor: str | None = Field(default=None, max_length=400)

    @field_validator("state", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            return [v.strip() for item in value for v in str(item).split(",") if v.strip()]
        return value


class MissionPage(Output):
    items: list[Mission]
    totals: dict[str, int] = Field(description="tasks per state matching the filters")
    next_cursor: str | None


class RunOut(Output):
    id: str
    attempt: int
    session_id: str | None
    state: str
    exit_code: int | None
    reason: str
    output_bytes: int
    started_at: dt.datetime | None
    ended_at: dt.datetime | None


class TransitionOut(Output):
    time: dt.datetime
    actor: str
    from_state: str | None
    to_state: str | None
    cause: str


class MissionDetail(Mission):
    runs: list[RunOut]
    transitions: list[TransitionOut] = Field(description="from the audit log, oldest first")


@api.get(
    "/api/v2/admin/missions",
    query=MissionQuery,
    response=MissionPage,
    role=Role.viewer,
    summary="Tasks across instances with per-state totals (your own, or all as admin)",
    tag="missions",
)
async def list_missions(call: Call[NoBody, MissionQuery]) -> MissionPage:
    caller = caller_of(call.require_principal())
    q = call.query
    if q.owner is not None and not caller.is_admin and q.owner != caller.subject:
        raise ProblemError(403, "only admins may list other owners' missions", code="forbidden")
    owner = q.owner if caller.is_admin else caller.subject
    flt = TaskFilter(instance_id=q.instance_id, owner=owner, states=tuple(q.state or ()))
    tasks = call.app[TASKS]
    records, next_cursor = await list_page(tasks, flt, limit=q.limit, cursor=q.cursor)
    totals = await tasks.store.count_by_state(TaskFilter(instance_id=q.instance_id, owner=owner))
    return MissionPage(items=[mission(r) for r in records], totals=totals, next_cursor=next_cursor)


@api.get(
    "/api/v2/admin/missions/{task_id}",
    response=MissionDetail,
    role=Role.viewer,
    summary="One mission with its runs and state transitions",
    tag="missions",
)
async def get_mission(call: Call[NoBody, NoQuery]) -> MissionDetail:
    caller = caller_of(call.require_principal())
    task_id = call.match["task_id"]
    tasks = call.app[TASKS]
    rec = await visible_task(tasks, task_id, caller, "mission")
    runs = await tasks.store.runs(task_id)
    audit = await services(call.request).audit.query(
        subject_type="task", subject_id=task_id, limit=1000
    )
    return MissionDetail(
        **mission(rec).model_dump(),
        runs=[RunOut.model_validate(r) for r in runs],
        transitions=[
            TransitionOut.model_validate(a) for a in audit if a.action == "task.transition"
        ],
    )
