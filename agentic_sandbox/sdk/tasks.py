"""Tasks through the admin API's views: submit, cancel and logs over the v1 task API, the
mission roll-up for listing and detail. (A2A callers use the official `a2a-sdk`.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from agentic_sandbox.sdk.errors import Unauthorized
from agentic_sandbox.sdk.models import SubmittedTask, TaskDetail, TaskPage
from agentic_sandbox.sdk.operations import ADMIN, Resource

V1 = "/api/v1/tasks"


class TaskLog(NamedTuple):
    """One event of a task's log stream: `output` (`data["text"]`), `state`, or `end`
    (`data["state"]`, `data["exit_code"]`)."""

    kind: str
    data: dict[str, Any]


class AsyncTasks(Resource):
    async def send(
        self,
        instance_id: str,
        command: str | None = None,
        *,
        skill: str | None = None,
        data: Any = None,
        idempotency_key: str | None = None,
    ) -> SubmittedTask:
        """Submit a task: a bash command line for the shell skill, or `data` for `skill`."""
        body: dict[str, Any] = {"instance_id": instance_id}
        for key, value in (
            ("command", command),
            ("skill", skill),
            ("data", data),
            ("idempotency_key", idempotency_key),
        ):
            if value is not None:
                body[key] = value
        return await self._t.model(SubmittedTask, "POST", V1, json_body=body)

    async def list(
        self,
        *,
        instance_id: str | None = None,
        owner: str | None = None,
        state: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> TaskPage:
        """Tasks across instances, with per-state totals; `next_cursor` reads on."""
        params = {
            "instance_id": instance_id,
            "owner": owner,
            "state": state,
            "limit": limit,
            "cursor": cursor,
        }
        return await self._t.model(TaskPage, "GET", f"{ADMIN}/missions", params=params)

    async def get(self, task_id: str) -> TaskDetail:
        """One task with its runs and state transitions."""
        return await self._t.model(TaskDetail, "GET", f"{ADMIN}/missions/{task_id}")

    async def cancel(self, task_id: str) -> SubmittedTask:
        """TERM to its run, then KILL after the grace period."""
        return await self._t.model(SubmittedTask, "DELETE", f"{V1}/{task_id}")

    async def wait(self, task_id: str, *, timeout: float | None = None) -> TaskDetail:
        """Until the task is completed, failed, canceled or rejected."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.1
        while True:
            task = await self.get(task_id)
            if task.done:
                return task
            if deadline is not None and time.monotonic() + delay > deadline:
                raise TimeoutError(f"task {task_id} still {task.state} after {timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    async def logs(self, task_id: str) -> AsyncIterator[TaskLog]:
        """The task's output and states as they happen (what exists first), to its end."""
        async for sse in self._t.sse(f"{V1}/{task_id}/logs"):
            data = sse.json()
            if sse.event == "revoked":
                raise Unauthorized(401, f"the log stream ended: {data.get('reason', 'revoked')}")
            yield TaskLog(sse.event, data if isinstance(data, dict) else {"data": data})
