"""A task run's budget: the message's `metadata.budget` within the instance's loadout budgets,
handed to the run's session; a run its budget ended fails with the named reason, and every
run's usage lands on the task record, its run row and its terminal event."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from agentic_sandbox.broker.agentlink import BudgetSpec
from agentic_sandbox.broker.observability.events import EventFilter
from agentic_sandbox.broker.sessions import BudgetSupport, RunUsage
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks import InvalidTaskInput, TaskState
from tests.unit.a2a.conftest import Env

S = TaskState
TIGHT = {"defaults": {"timeout_seconds": 30}, "maxima": {"timeout_seconds": 60, "pids": 64}}


async def test_the_run_gets_the_loadout_budget_and_a_message_may_lower_it(env: Env) -> None:
    await env.add_instance(budgets=TIGHT)
    rec = await env.submit("true")  # a pids ceiling an agent without cgroups cannot enforce
    assert rec.state is S.rejected and "metadata.budget.pids" in str(rec.status_message)
    env.fake.support = BudgetSupport("cgroup-v2", ("timeout", "output_bytes", "pids"), "")
    await env.submit("true")
    (first,) = await env.fake.wait_session()
    # the default timeout, and a field with only a ceiling runs at the ceiling
    assert first.spec.budget == BudgetSpec(timeout_ms=30_000, pids=64)
    await env.submit("true", metadata={"budget": {"timeout_seconds": 2.5, "pids": 8}})
    second = (await env.fake.wait_session(2))[1]
    assert second.spec.budget == BudgetSpec(timeout_ms=2500, pids=8)


async def test_over_a_ceiling_or_a_bad_value_is_refused_naming_the_field(env: Env) -> None:
    await env.add_instance(budgets=TIGHT)
    with pytest.raises(InvalidTaskInput) as info:
        await env.submit("true", metadata={"budget": {"timeout_seconds": 61}})
    assert info.value.field == "metadata.budget.timeout_seconds"
    assert "60" in info.value.message and "timeout_seconds" in info.value.message
    with pytest.raises(InvalidTaskInput) as info:
        await env.submit("true", metadata={"budget": {"memory_mib": "lots"}})
    assert info.value.field == "message.metadata.budget.memory_mib"
    with pytest.raises(InvalidTaskInput) as info:
        await env.submit("true", metadata={"budget": {"bogus": 1}})
    assert info.value.field == "message.metadata.budget.bogus"
    assert env.fake.sessions == {}


async def test_a_budget_the_agent_cannot_enforce_rejects_the_task(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("true", metadata={"budget": {"memory_mib": 64}})
    assert rec.state is S.rejected
    text = str(rec.status_message)
    assert "metadata.budget.memory_mib" in text and "no cgroups here" in text
    env.fake.support = BudgetSupport("cgroup-v1", ("timeout", "output_bytes", "memory"), "")
    await env.submit("true", metadata={"budget": {"memory_mib": 64}})
    (sess,) = await env.fake.wait_session()
    assert sess.spec.budget is not None and sess.spec.budget.memory_bytes == 64 << 20


@pytest.mark.parametrize(
    ("reason", "words"),
    [("timeout", "went past its 1.5 s wall-clock budget"), ("output-limit", "1000 output")],
)
async def test_an_exceeded_budget_fails_the_task_with_the_reason(
    env: Env, reason: str, words: str
) -> None:
    await env.add_instance()
    budget = {"timeout_seconds": 1.5, "output_bytes": 1000}
    rec = await env.submit("yes", metadata={"budget": budget})
    (sess,) = await env.fake.wait_session()
    await env.until(rec.id, S.working)
    env.fake.emit(sess.id, b"y\r\n" * 10)
    usage = RunUsage(
        cpu_us=1_500_000, peak_memory_bytes=5 << 20, output_bytes=30, enforcement="none"
    )
    env.fake.exit(sess.id, None, "KILL", exceeded=reason, usage=usage)
    done = await env.until(rec.id, S.failed)
    message = done.status_message["parts"][0]["text"]  # type: ignore[index]
    assert message.startswith(f"{reason}: ") and words in message
    assert done.metadata["budgetExceeded"] == reason
    assert done.metadata["usage"] == {
        "cpuSeconds": 1.5,
        "peakMemoryBytes": 5 << 20,
        "outputBytes": 30,
        "enforcement": "none",
    }
    assert done.metadata["budget"]["timeout_seconds"] == 1.5
    await env.svc.events.flush()
    (end,) = [
        e
        for e in await env.svc.events.query(0, 100, EventFilter(task_id=rec.id))
        if e.type == "task.failed"
    ]
    assert end.data["exceeded"] == reason
    assert end.data["usage"]["cpu_seconds"] == 1.5
    assert end.data["usage"]["peak_memory_bytes"] == 5 << 20
    async with env.svc.db.session() as s:
        run = (await s.scalars(select(m.Run).where(m.Run.task_id == rec.id))).one()
    assert (run.exceeded, run.cpu_us, run.peak_memory_bytes) == (reason, 1_500_000, 5 << 20)
    assert run.state == "exceeded" and run.budget is not None


async def test_a_run_within_its_budget_records_its_usage(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("true")
    (sess,) = await env.fake.wait_session()
    usage = RunUsage(cpu_us=2000, peak_memory_bytes=1 << 20, output_bytes=0, enforcement="none")
    env.fake.exit(sess.id, 0, usage=usage)
    done = await env.until(rec.id, S.completed)
    assert "budgetExceeded" not in done.metadata
    assert done.metadata["usage"]["cpuSeconds"] == 0.002
