"""The task layer against a fake session layer: runs, HITL, cancel, quotas, idempotency,
recovery after a restart, visibility and streams."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import update

from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks import (
    Caller,
    IdempotencyConflict,
    QuotaExceeded,
    TaskNotCancelable,
    TaskNotFound,
    TaskNotWaiting,
    TaskState,
)
from tests.support.fake_sessions import FakeSessions
from tests.unit.a2a.conftest import ALICE, BOB, GREET_SKILL, Env, running_env, settings_for

S = TaskState


async def test_a_task_runs_in_a_session_and_completes(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("echo hello")
    assert rec.state in (S.submitted, S.working)
    (sess,) = await env.fake.wait_session()
    assert sess.spec.command == ["bash", "-lc", "echo hello"]
    assert sess.spec.task_id == rec.id and sess.spec.owner == "alice"
    assert sess.spec.env["A2A_TASK_ID"] == rec.id
    await env.until(rec.id, S.working)
    env.fake.emit(sess.id, b"hello\r\n")
    env.fake.exit(sess.id, 0)
    done = await env.until(rec.id, S.completed)
    assert done.output_text() == "hello\r\n"
    assert done.metadata["sessionId"] == sess.id
    assert done.metadata["exitCode"] == 0
    task = done.to_a2a()
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    assert task["artifacts"][0]["parts"] == [{"text": "hello\r\n"}]
    assert [h["role"] for h in task["history"]] == ["ROLE_USER", "ROLE_AGENT"]
    audit = await env.svc.audit.query(subject_type="task", subject_id=rec.id)
    assert [(a.from_state, a.to_state) for a in audit] == [
        (None, "submitted"),
        ("submitted", "working"),
        ("working", "completed"),
    ]
    assert all(a.actor for a in audit)
    await env.svc.events.flush()
    types = [e.type for e in await env.svc.events.query(0, 100, _flt(rec.id))]
    assert types == ["task.submitted", "task.working", "task.completed"]
    # after the end the task is served from the database, output included
    assert env.tasks.live.get(rec.id) is None
    stored = await env.tasks.get(rec.id, ALICE)
    assert stored.output_text() == "hello\r\n" and stored.state is S.completed


def _flt(task_id: str):  # type: ignore[no-untyped-def]
    from agentic_sandbox.broker.observability.events import EventFilter

    return EventFilter(task_id=task_id)


async def test_nonzero_exit_fails_with_the_code(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("false")
    (sess,) = await env.fake.wait_session()
    env.fake.exit(sess.id, 3)
    done = await env.until(rec.id, S.failed)
    assert done.metadata["exitCode"] == 3
    assert done.status_message is not None
    assert "exit code 3" in done.status_message["parts"][0]["text"]


async def test_schema_invalid_data_is_rejected_naming_the_field(env: Env) -> None:
    await env.add_instance(skills=[GREET_SKILL])
    rec = await env.submit(parts=[{"data": {"name": 42}}], metadata={"skillId": "greet"})
    assert rec.state is S.rejected
    text = rec.status_message["parts"][0]["text"]  # type: ignore[index]
    assert "data.name" in text and "not of type 'string'" in text
    assert env.fake.sessions == {}
    ok = await env.submit(parts=[{"data": {"name": "Ada"}}], metadata={"skillId": "greet"})
    (sess,) = await env.fake.wait_session()
    assert sess.spec.command == ["greet", '{"name":"Ada"}']
    assert sess.spec.env["A2A_DATA"] == '{"name":"Ada"}'
    assert ok.state in (S.submitted, S.working)


async def test_unknown_skill_and_missing_agent_are_rejected(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("x", metadata={"skillId": "nope"})
    assert rec.state is S.rejected and "unknown skill 'nope'" in str(rec.status_message)
    env.fake.ready.discard("vm1")
    rec = await env.submit("uptime")
    assert rec.state is S.rejected and "instance not ready" in str(rec.status_message)


async def test_unknown_or_foreign_instance_is_not_found(env: Env) -> None:
    await env.add_instance("vm1", owner="alice")
    with pytest.raises(TaskNotFound):
        await env.submit("x", iid="nope")
    with pytest.raises(TaskNotFound):
        await env.submit("x", caller=BOB)


async def test_hitl_prompt_then_answer(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("read -p 'Continue? (y/n) ' a; echo got $a")
    (sess,) = await env.fake.wait_session()
    await env.until(rec.id, S.working)
    stream = await env.tasks.open_stream(rec.id, ALICE)
    env.fake.emit(sess.id, b"Continue? (y/n) ")
    env.fake.prompt(sess.id, "Continue? (y/n)")
    waiting = await env.until(rec.id, S.input_required)
    assert waiting.status_message["parts"][0]["text"] == "Continue? (y/n)"  # type: ignore[index]
    # the prompt's output was streamed before the state change
    kinds = []
    events = stream.events().__aiter__()
    for _ in range(2):
        ev = await asyncio.wait_for(events.__anext__(), 2)
        kinds.append(next(iter(ev)))
    assert kinds == ["artifactUpdate", "statusUpdate"]
    answered = await env.submit("y", taskId=rec.id)
    assert answered.state is S.working
    assert sess.inputs == [b"y\r"]
    env.fake.emit(sess.id, b"y\r\ngot y\r\n")
    env.fake.exit(sess.id, 0)
    done = await env.until(rec.id, S.completed)
    assert "got y" in done.output_text()
    roles = [h["role"] for h in done.history]
    assert roles == ["ROLE_USER", "ROLE_AGENT", "ROLE_USER", "ROLE_AGENT"]
    stream.close()


async def test_follow_up_to_a_task_not_waiting_is_refused(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("sleep 9")
    await env.until(rec.id, S.working)
    with pytest.raises(TaskNotWaiting):
        await env.submit("y", taskId=rec.id)


async def test_cancel_sends_term(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("sleep 60")
    (sess,) = await env.fake.wait_session()
    await env.until(rec.id, S.working)
    out = await env.tasks.cancel(rec.id, ALICE)
    assert out.state is S.canceled
    assert sess.signals == ["TERM"]
    with pytest.raises(TaskNotCancelable):
        await env.tasks.cancel(rec.id, ALICE)


async def test_cancel_kills_after_the_grace_period(env: Env) -> None:
    await env.add_instance()
    env.fake.ignore_term = True
    rec = await env.submit("trap '' TERM; sleep 60")
    (sess,) = await env.fake.wait_session()
    await env.until(rec.id, S.working)
    out = await env.tasks.cancel(rec.id, ALICE)
    assert out.state is S.canceled
    assert sess.signals == ["TERM", "KILL"]
    assert out.metadata["exitSignal"] == "KILL"


async def test_idempotency_by_message_id(env: Env) -> None:
    await env.add_instance()
    a = await env.submit("echo 1", messageId="m-1")
    b = await env.submit("echo 1", messageId="m-1")
    assert a.id == b.id
    with pytest.raises(IdempotencyConflict):
        await env.submit("echo 2", messageId="m-1")
    other = await env.submit("echo 1", messageId="m-1", caller=Caller("alice2", "t", True))
    assert other.id != a.id  # keys are per owner


@pytest.mark.parametrize("env", [{"task_max_running": 1, "task_max_pending": 1}], indirect=True)
async def test_quota_queue_then_refuse(env: Env) -> None:
    await env.add_instance()
    first = await env.submit("sleep 60")
    await env.until(first.id, S.working)
    second = await env.submit("echo queued")
    assert second.state is S.submitted
    third = await env.submit("echo too many")
    assert third.state is S.rejected and "quota" in str(third.status_message)
    with pytest.raises(QuotaExceeded) as err:
        await env.tasks.submit(
            instance_id="vm1",
            caller=ALICE,
            message={"messageId": "v1-x", "role": "ROLE_USER", "parts": [{"text": "x"}]},
            refuse_over_quota=True,
        )
    assert err.value.retry_after > 0
    # when the first ends, the queued one starts
    sess = (await env.fake.wait_session())[0]
    env.fake.exit(sess.id, 0)
    await env.until(second.id, S.working)


@pytest.mark.parametrize("env", [{"task_max_running_per_owner": 1}], indirect=True)
async def test_per_owner_limit_lets_others_pass(env: Env) -> None:
    await env.add_instance("vm1", owner="alice")
    await env.add_instance("vm2", owner="bob")
    a1 = await env.submit("sleep 60")
    a2 = await env.submit("sleep 60")
    b1 = await env.submit("sleep 60", caller=BOB, iid="vm2")
    await env.until(a1.id, S.working)
    await env.until(b1.id, S.working)
    assert (await env.tasks.get(a2.id, ALICE)).state is S.submitted
    canceled = await env.tasks.cancel(a2.id, ALICE)
    assert canceled.state is S.canceled


async def test_tasks_are_private_to_their_owner(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("echo secret")
    with pytest.raises(TaskNotFound):
        await env.tasks.get(rec.id, BOB)
    with pytest.raises(TaskNotFound):
        await env.tasks.cancel(rec.id, BOB)
    with pytest.raises(TaskNotFound):
        await env.tasks.get(rec.id, ALICE, instance_id="other")
    assert (await env.tasks.get(rec.id, Caller("root", "t", is_admin=True))).id == rec.id


async def test_utf8_split_across_chunks_is_kept_whole(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("printf 'é€'")
    (sess,) = await env.fake.wait_session()
    data = "é€".encode()
    for i in range(len(data)):
        env.fake.emit(sess.id, data[i : i + 1])
        await asyncio.sleep(0.005)
    env.fake.exit(sess.id, 0)
    done = await env.until(rec.id, S.completed)
    assert done.output_text() == "é€"


async def test_restart_resumes_the_run_from_its_offset(tmp_path: Path) -> None:
    fake = FakeSessions()
    settings = settings_for(tmp_path)
    async with running_env(settings, fake) as e1:
        await e1.add_instance()
        rec = await e1.submit("long job")
        (sess,) = await fake.wait_session()
        await e1.until(rec.id, S.working)
        fake.emit(sess.id, b"part one\n")
        for _ in range(100):
            run = e1.tasks.live.get(rec.id).run  # type: ignore[union-attr]
            if run.persisted_offset == 9:  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.01)
        fake.emit(sess.id, b"part two\n")  # streamed, maybe not stored before the stop
    # the server is down; the run goes on in the guest
    fake.emit(sess.id, b"part three\n")
    fake.listeners.clear()
    fake.unavailable_follow = 1  # the agent is not back at once
    async with running_env(settings, fake) as e2:
        fake.exit(sess.id, 0)
        done = await e2.until(rec.id, S.completed)
        assert done.output_text() == "part one\npart two\npart three\n"
        assert len(fake.sessions) == 1  # re-adopted, not restarted
        audit = await e2.svc.audit.query(subject_type="task", subject_id=rec.id)
        assert [a.to_state for a in audit].count("completed") == 1


async def test_restart_adopts_a_run_whose_working_was_not_stored(tmp_path: Path) -> None:
    """A leader killed right after a run's session opened on the agent, before `working` was
    stored: the task row says `submitted`, its run names no session, the session row (stored
    before the open) names the task. The next leader adopts that run; it never starts it
    again."""
    fake = FakeSessions()
    settings = settings_for(tmp_path)
    async with running_env(settings, fake) as e1:
        await e1.add_instance()
        rec = await e1.submit("long job")
        (sess,) = await fake.wait_session()
        await e1.until(rec.id, S.working)
        fake.emit(sess.id, b"before\n")
    # what the database holds when the leader died inside the window
    db = Database(settings.effective_database_url)
    try:
        async with db.session() as s:
            await s.execute(update(m.Task).where(m.Task.id == rec.id).values(state="submitted"))
            await s.execute(
                update(m.Run)
                .where(m.Run.task_id == rec.id)
                .values(session_id=None, state="starting")
            )
            s.add(m.Session(id=sess.id, instance_id="vm1", owner="alice", task_id=rec.id))
            await s.commit()
    finally:
        await db.close()
    fake.listeners.clear()
    async with running_env(settings, fake) as e2:
        await e2.until(rec.id, S.working)
        fake.emit(sess.id, b"after\n")
        fake.exit(sess.id, 0)
        done = await e2.until(rec.id, S.completed)
        assert "after\n" in done.output_text()
        assert len(fake.sessions) == 1  # adopted, not started again
        runs = await e2.tasks.store.runs(rec.id)
        assert [r.session_id for r in runs] == [sess.id]


async def test_a_stop_lets_a_run_being_started_finish_starting(tmp_path: Path) -> None:
    """A graceful stop (a control-plane upgrade) while a run's session is being opened: the
    open finishes and `working` is stored, so the next server follows the run instead of
    giving it up as one that may or may not have started."""
    fake = FakeSessions()
    fake.open_gate = asyncio.Event()
    settings = settings_for(tmp_path)
    async with running_env(settings, fake) as e1:
        await e1.add_instance()
        rec = await e1.submit("job")
        await asyncio.wait_for(fake.opening.wait(), 5)
        asyncio.get_running_loop().call_later(0.3, fake.open_gate.set)  # the agent answers
    fake.open_gate = None
    fake.listeners.clear()
    async with running_env(settings, fake) as e2:
        (sess,) = fake.sessions.values()
        assert (await e2.tasks.get(rec.id, ALICE)).state is S.working
        fake.emit(sess.id, b"done\n")
        fake.exit(sess.id, 0)
        done = await e2.until(rec.id, S.completed)
        assert done.output_text() == "done\n"


async def test_restart_fails_a_run_that_is_gone(tmp_path: Path) -> None:
    fake = FakeSessions()
    settings = settings_for(tmp_path, task_recovery_grace_seconds=0.5)
    async with running_env(settings, fake) as e1:
        await e1.add_instance()
        rec = await e1.submit("job")
        await fake.wait_session()
        await e1.until(rec.id, S.working)
    fake.sessions.clear()  # the agent lost it
    async with running_env(settings, fake) as e2:
        done = await e2.until(rec.id, S.failed, seconds=10)
        assert "run lost" in str(done.status_message)


async def test_restart_requeues_submitted_tasks(tmp_path: Path) -> None:
    fake = FakeSessions()
    settings = settings_for(tmp_path, task_max_running=1)
    async with running_env(settings, fake) as e1:
        await e1.add_instance()
        first = await e1.submit("sleep 60")
        queued = await e1.submit("echo later")
        await e1.until(first.id, S.working)
    async with running_env(settings, fake) as e2:
        assert (await e2.tasks.get(queued.id, ALICE)).state is S.submitted
        fake.exit(next(iter(fake.sessions)), 0)
        await e2.until(first.id, S.completed)
        await e2.until(queued.id, S.working)


async def test_stream_snapshot_then_events_until_the_end(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("x")
    (sess,) = await env.fake.wait_session()
    await env.until(rec.id, S.working)
    stream = await env.tasks.open_stream(rec.id, ALICE)
    assert stream.snapshot.state is S.working
    env.fake.emit(sess.id, b"a")
    env.fake.emit(sess.id, b"b")
    env.fake.exit(sess.id, 0)
    got = [ev async for ev in stream.events()]
    arts = [e["artifactUpdate"] for e in got if "artifactUpdate" in e]
    assert "".join(a["artifact"]["parts"][0]["text"] for a in arts) == "ab"
    assert arts[-1].get("lastChunk") is True
    assert all(a.get("append") for a in arts[1:])
    assert got[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
    # a stream of an ended task is just its snapshot
    again = await env.tasks.open_stream(rec.id, ALICE)
    assert again.subscriber is None and again.snapshot.state is S.completed


async def test_a_slow_subscriber_is_resynced_not_waited_for(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("flood")
    (sess,) = await env.fake.wait_session()
    await env.until(rec.id, S.working)
    stream = await env.tasks.open_stream(rec.id, ALICE, queue=4)
    for i in range(50):
        env.fake.emit(sess.id, f"line {i}\n".encode())
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    env.fake.exit(sess.id, 0)
    got = [ev async for ev in stream.events()]
    assert any("task" in ev for ev in got)  # a resync snapshot
    done = await env.until(rec.id, S.completed)
    assert done.output_text().count("line") == 50


async def test_a_run_whose_agent_stays_away_fails(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit("long job")
    await env.fake.wait_session()
    await env.until(rec.id, S.working)
    env.fake.ready.discard("vm1")  # the link is down and stays down past the grace period
    done = await env.until(rec.id, S.failed, seconds=10)
    assert "agent was away" in str(done.status_message)


async def test_output_beyond_the_cap_is_truncated_in_storage_only(tmp_path: Path) -> None:
    fake = FakeSessions()
    async with running_env(settings_for(tmp_path, task_output_max_bytes=1024), fake) as e:
        await e.add_instance()
        rec = await e.submit("yes")
        (sess,) = await fake.wait_session()
        stream = await e.tasks.open_stream(rec.id, ALICE)
        for _ in range(10):
            fake.emit(sess.id, b"y" * 500)
        fake.exit(sess.id, 0)
        streamed = "".join(
            [
                ev["artifactUpdate"]["artifact"]["parts"][0]["text"]
                async for ev in stream.events()
                if "artifactUpdate" in ev
            ]
        )
        assert streamed == "y" * 5000  # streams carry everything
        done = await e.until(rec.id, S.completed)
        assert done.metadata["outputTruncated"] is True
        assert done.output_text().startswith("y" * 1024) and "truncated" in done.output_text()


async def test_huge_numbers_in_data_do_not_break_submit(env: Env) -> None:
    await env.add_instance()
    rec = await env.submit(parts=[{"text": "echo big"}, {"data": {"n": 2**70, "x": 1e308}}])
    assert rec.state in (S.submitted, S.working)
    (sess,) = await env.fake.wait_session()
    assert str(2**70) in sess.spec.env["A2A_DATA"]
