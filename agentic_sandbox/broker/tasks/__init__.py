"""Tasks: the A2A task state machine, its store, scheduler, runs (PTY sessions), push
notifications, the deprecated v1 task API and the admin missions roll-up.

Public face: `TasksComponent` (the server part), `TaskService` and what its callers pass and
get (`Caller`, `PushRequest`, `TaskRecord`, `TaskStream`, `TaskFilter`, `TaskState`, the errors).
"""

from agentic_sandbox.broker.tasks.component import TasksComponent
from agentic_sandbox.broker.tasks.errors import (
    IdempotencyConflict,
    InvalidPushConfig,
    InvalidTaskInput,
    PushConfigNotFound,
    QuotaExceeded,
    TaskError,
    TaskNotCancelable,
    TaskNotFound,
    TaskNotWaiting,
    UnsupportedContent,
)
from agentic_sandbox.broker.tasks.keys import TASKS
from agentic_sandbox.broker.tasks.push import PushConfigView
from agentic_sandbox.broker.tasks.record import TaskRecord, parse_timestamp, timestamp
from agentic_sandbox.broker.tasks.service import Caller, PushRequest, TaskService, TaskStream
from agentic_sandbox.broker.tasks.skills import AgentProfile, SkillSpec
from agentic_sandbox.broker.tasks.states import TaskState
from agentic_sandbox.broker.tasks.store import TaskFilter

__all__ = [
    "TASKS",
    "AgentProfile",
    "Caller",
    "IdempotencyConflict",
    "InvalidPushConfig",
    "InvalidTaskInput",
    "PushConfigNotFound",
    "PushConfigView",
    "PushRequest",
    "QuotaExceeded",
    "SkillSpec",
    "TaskError",
    "TaskFilter",
    "TaskNotCancelable",
    "TaskNotFound",
    "TaskNotWaiting",
    "TaskRecord",
    "TaskService",
    "TaskState",
    "TaskStream",
    "TasksComponent",
    "UnsupportedContent",
    "parse_timestamp",
    "timestamp",
]
