"""The task layer's store on a real PostgreSQL: runs, the atomic quota claim, pagination,
push configs and recovery after a restart (the fake session layer stands in for agents)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentic_sandbox.broker.tasks import TaskFilter, TaskState
from tests.support.fake_sessions import FakeSessions
from tests.unit.a2a.conftest import ALICE, running_env, settings_for

S = TaskState


async def test_tasks_on_postgres(pg_url: str, tmp_path: Path) -> None:
    fake = FakeSessions()
    settings = settings_for(tmp_path, database_url=pg_url, task_max_running=1)
    async with running_env(settings, fake) as e:
        await e.add_instance()
        first = await e.submit("job one")
        queued = await e.submit("job two", messageId="dup")
        again = await e.submit("job two", messageId="dup")
        assert again.id == queued.id
        (sess,) = await fake.wait_session()
        await e.until(first.id, S.working)
        fake.emit(sess.id, "héllo\n".encode())
        await asyncio.sleep(0.1)
        assert (await e.tasks.get(queued.id, ALICE)).state is S.submitted  # quota: one at a time
        fake.exit(sess.id, 0)
        done = await e.until(first.id, S.completed)
        assert done.output_text() == "héllo\n"
        await e.until(queued.id, S.working)
        records, page = await e.tasks.list_tasks(TaskFilter(owner="alice"), page_size=1)
        assert page.total == 2 and page.next_token
        rest, page2 = await e.tasks.list_tasks(
            TaskFilter(owner="alice"), page_size=1, page_token=page.next_token
        )
        assert {records[0].id, rest[0].id} == {first.id, queued.id} and page2.next_token == ""
        from agentic_sandbox.broker.tasks.service import PushRequest

        view = await e.tasks.put_push_config(
            await e.tasks.get(queued.id, ALICE), PushRequest(url="http://127.0.0.1:9/x", token="t")
        )
        assert [v.id for v in await e.tasks.push_configs(await e.tasks.get(queued.id, ALICE))] == [
            view.id
        ]
    # restart: the running task is re-adopted from its stored offset
    second = next(s for s in fake.sessions.values() if s.id != sess.id)
    fake.emit(second.id, b"after restart\n")
    async with running_env(settings, fake) as e2:
        fake.exit(second.id, 0)
        finished = await e2.until(queued.id, S.completed)
        assert finished.output_text() == "after restart\n"
