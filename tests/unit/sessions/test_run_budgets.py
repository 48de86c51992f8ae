"""A run's budget (an exec's, a PTY session's, a task run's): the request within the loadout's
defaults and ceilings, and what the agent can enforce — each refusal names the request field."""

from __future__ import annotations

import pytest

from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.sessions import BudgetIn, budgets
from agentic_sandbox.provision import Budgets, LoadoutCatalog, LoadoutError


def test_request_lowers_defaults_and_stops_at_ceilings() -> None:
    b = Budgets.model_validate(
        {"defaults": {"memory_mib": 256}, "maxima": {"memory_mib": 512, "pids": 64}}
    )
    got = budgets.resolve(BudgetIn(), b)
    assert (got.timeout_seconds, got.memory_mib, got.pids, got.cpus) == (600, 256, 64, None)
    assert budgets.resolve(BudgetIn(memory_mib=100, pids=8), b).model_dump()["pids"] == 8
    with pytest.raises(ProblemError) as info:
        budgets.resolve(BudgetIn(memory_mib=1024), b)
    assert info.value.status == 422
    assert info.value.errors and info.value.errors[0]["field"] == "body.budget.memory_mib"
    assert "512" in info.value.detail


def test_loadouts_merge_budgets_and_refuse_defaults_above_ceilings() -> None:
    cat = LoadoutCatalog()
    cat.add({"name": "base", "budgets": {"maxima": {"memory_mib": 512}}})
    cat.add({"name": "child", "extends": "base", "budgets": {"defaults": {"memory_mib": 128}}})
    child = cat.resolve("child").budgets
    assert child.defaults.memory_mib == 128 and child.maxima.memory_mib == 512
    assert child.maxima.timeout_seconds == 86400  # the built-in ceiling stays
    with pytest.raises(LoadoutError, match=r"defaults\.pids"):
        cat.add({"name": "bad", "budgets": {"defaults": {"pids": 9}, "maxima": {"pids": 5}}})


def test_instance_budgets_prefer_the_record_then_the_catalog() -> None:
    cat = LoadoutCatalog()
    cat.add({"name": "tight", "budgets": {"maxima": {"pids": 10}}})
    recorded = {"budgets": {"maxima": {"pids": 3}}}
    assert budgets.instance_budgets(recorded, "tight", cat).maxima.pids == 3
    assert budgets.instance_budgets({}, "tight", cat).maxima.pids == 10
    assert budgets.instance_budgets(None, "unknown", cat) == Budgets()


def test_budgets_the_agent_cannot_enforce_are_refused_by_field() -> None:
    got = budgets.resolve(BudgetIn(cpus=0.5), Budgets())
    budgets.check_support(got, "cgroup-v1", ("timeout", "output_bytes", "cpu"), "", "i1")
    with pytest.raises(ProblemError) as info:
        budgets.check_support(got, "none", ("timeout", "output_bytes"), "not root", "i1")
    assert info.value.errors and info.value.errors[0]["field"] == "body.budget.cpus"
    assert "not root" in info.value.detail


def test_link_values_and_agent_field_names() -> None:
    got = budgets.resolve(BudgetIn(timeout_seconds=1.5, memory_mib=64, cpus=0.25), Budgets())
    pb_budget = budgets.to_spec(got)
    assert (pb_budget.timeout_ms, pb_budget.memory_bytes, pb_budget.cpu_millis) == (
        1500,
        64 << 20,
        250,
    )
    assert budgets.request_field("budget.cpu") == "body.budget.cpus"
    assert budgets.request_field("cwd") == "body.cwd"


def test_an_interactive_session_gets_a_timeout_only_when_it_asks() -> None:
    b = Budgets.model_validate({"defaults": {"memory_mib": 256}, "maxima": {"memory_mib": 512}})
    got = budgets.resolve(BudgetIn(), b, interactive=True)
    assert (got.timeout_seconds, got.memory_mib) == (None, 256)
    assert budgets.agent_spec(got) is not None
    asked = budgets.resolve(BudgetIn(timeout_seconds=5), b, interactive=True)
    assert asked.timeout_seconds == 5
    with pytest.raises(budgets.BudgetInvalid) as info:
        budgets.resolve(BudgetIn(timeout_seconds=90000), b, interactive=True)
    assert info.value.field == "body.budget.timeout_seconds"
    # nothing limited at all: the session gets no budget (and no cgroup of its own)
    assert budgets.agent_spec(budgets.resolve(BudgetIn(), Budgets(), interactive=True)) is None


def test_fields_are_named_where_the_caller_gave_them() -> None:
    b = Budgets.model_validate({"maxima": {"pids": 5}})
    with pytest.raises(budgets.BudgetInvalid) as info:
        budgets.resolve(BudgetIn(pids=6), b, where="metadata.budget")
    assert info.value.field == "metadata.budget.pids" and info.value.status == 422
