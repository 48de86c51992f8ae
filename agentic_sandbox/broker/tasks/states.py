"""Task states and the transitions allowed between them (A2A 1.0 task lifecycle).

This table is the only place that says which transition is legal; `machine.TaskMachine` is the
only code that changes a task's state, and it asks `check_transition` first.

    submitted      -> working | rejected | canceled
    working        -> completed | failed | canceled | input-required | auth-required
    input-required -> working | canceled | failed | completed
    auth-required  -> working | canceled | failed | completed
    completed, failed, canceled, rejected: terminal, never change

The spec lists `working <-> input-required`; a run can also end (its process exits, is lost or
is canceled) while it waits for an answer, so the interrupted states may end directly too.
"""

from __future__ import annotations

from enum import StrEnum


class TaskState(StrEnum):
    submitted = "submitted"
    working = "working"
    input_required = "input-required"
    auth_required = "auth-required"
    completed = "completed"
    failed = "failed"
    canceled = "canceled"
    rejected = "rejected"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def interrupted(self) -> bool:
        """Waiting for the client (a blocking SendMessage returns here)."""
        return self in INTERRUPTED

    @property
    def wire(self) -> str:
        """The A2A 1.0 enum name, e.g. `TASK_STATE_INPUT_REQUIRED`."""
        return "TASK_STATE_" + self.value.replace("-", "_").upper()

    @classmethod
    def from_wire(cls, name: str) -> TaskState:
        """Parse `TASK_STATE_WORKING` (or the kebab value `working`); ValueError otherwise."""
        if name.startswith("TASK_STATE_"):
            value = name[len("TASK_STATE_") :].lower().replace("_", "-")
        else:
            value = name
        return cls(value)


TERMINAL = frozenset(
    {TaskState.completed, TaskState.failed, TaskState.canceled, TaskState.rejected}
)
INTERRUPTED = frozenset({TaskState.input_required, TaskState.auth_required})
ACTIVE = frozenset({TaskState.working, TaskState.input_required, TaskState.auth_required})

ALLOWED: dict[TaskState, frozenset[TaskState]] = {
    TaskState.submitted: frozenset({TaskState.working, TaskState.rejected, TaskState.canceled}),
    TaskState.working: frozenset(
        {
            TaskState.completed,
            TaskState.failed,
            TaskState.canceled,
            TaskState.input_required,
            TaskState.auth_required,
        }
    ),
    TaskState.input_required: frozenset(
        {TaskState.working, TaskState.canceled, TaskState.failed, TaskState.completed}
    ),
    TaskState.auth_required: frozenset(
        {TaskState.working, TaskState.canceled, TaskState.failed, TaskState.completed}
    ),
    TaskState.completed: frozenset(),
    TaskState.failed: frozenset(),
    TaskState.canceled: frozenset(),
    TaskState.rejected: frozenset(),
}


class IllegalTransition(Exception):
    def __init__(self, task_id: str, from_state: TaskState, to_state: TaskState) -> None:
        super().__init__(f"task {task_id}: {from_state.value} -> {to_state.value} is not allowed")
        self.task_id = task_id
        self.from_state = from_state
        self.to_state = to_state


def can_transition(from_state: TaskState, to_state: TaskState) -> bool:
    return to_state in ALLOWED[from_state]


def check_transition(task_id: str, from_state: TaskState, to_state: TaskState) -> None:
    if not can_transition(from_state, to_state):
        raise IllegalTransition(task_id, from_state, to_state)
