"""The task state table: the spec's transitions, and terminal states never change."""

from __future__ import annotations

import itertools

import pytest

from agentic_sandbox.broker.tasks.states import (
    ALLOWED,
    TERMINAL,
    IllegalTransition,
    TaskState,
    check_transition,
)

S = TaskState


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (S.submitted, S.working),
        (S.submitted, S.rejected),
        (S.submitted, S.canceled),
        (S.working, S.completed),
        (S.working, S.failed),
        (S.working, S.canceled),
        (S.working, S.input_required),
        (S.input_required, S.working),
        (S.working, S.auth_required),
        (S.auth_required, S.working),
    ],
)
def test_spec_transitions_are_allowed(a: TaskState, b: TaskState) -> None:
    check_transition("t", a, b)


def test_terminal_states_never_change() -> None:
    for a, b in itertools.product(TERMINAL, TaskState):
        with pytest.raises(IllegalTransition):
            check_transition("t", a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (S.submitted, S.completed),
        (S.submitted, S.failed),
        (S.submitted, S.input_required),
        (S.working, S.submitted),
        (S.working, S.rejected),
        (S.input_required, S.rejected),
    ],
)
def test_other_transitions_are_refused(a: TaskState, b: TaskState) -> None:
    with pytest.raises(IllegalTransition) as err:
        check_transition("t1", a, b)
    assert f"{a.value} -> {b.value}" in str(err.value)


def test_every_state_has_a_row() -> None:
    assert set(ALLOWED) == set(TaskState)


def test_wire_names_round_trip() -> None:
    for state in TaskState:
        assert state.wire.startswith("TASK_STATE_")
        assert TaskState.from_wire(state.wire) is state
    assert S.input_required.wire == "TASK_STATE_INPUT_REQUIRED"
    with pytest.raises(ValueError):
        TaskState.from_wire("TASK_STATE_RUNNING")
