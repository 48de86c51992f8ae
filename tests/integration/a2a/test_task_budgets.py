"""Task and session budgets on a real host agent (root, this machine's cgroups), driven by the
official a2a-sdk client: a task past its timeout, one past its output bytes and a memory hog
each fail with the named reason in the final status message and the `task.failed` event, and
report their usage; an admin PTY session past its timeout ends with the reason in its
`session.*` event; a request above the loadout's ceiling is refused naming the field."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
from a2a.types import a2a_pb2 as pb
from a2a.utils import errors as sdk_errors
from google.protobuf.json_format import MessageToDict

from tests.integration.a2a.conftest import INSTANCE, Stack
from tests.support.a2a_sdk_client import (
    a2a_client,
    artifact_text,
    collect,
    send_request,
    state_name,
    text_message,
)

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroup budgets need the agent to run as root"),
]


async def _run(stack: Stack, text: str, budget: dict[str, Any]) -> pb.Task:
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        msg = text_message(text, metadata={"budget": budget})
        (ev,) = await collect(client.send_message(send_request(msg)))
        return ev.task


async def _event(stack: Stack, type_: str, **flt: str) -> dict[str, Any]:
    query = "&".join([f"type={type_}", *(f"{k}={v}" for k, v in flt.items())])
    deadline = time.monotonic() + 20
    while True:
        r = await stack.server.call("GET", f"/api/v1/events?{query}")
        assert r.status_code == 200, r.text
        items: list[dict[str, Any]] = r.json()["items"]
        if items or time.monotonic() > deadline:
            assert items, f"no {type_} event for {flt}"
            return items[-1]
        await asyncio.sleep(0.1)


def _ended_by(task: pb.Task, reason: str) -> dict[str, Any]:
    assert state_name(task) == "TASK_STATE_FAILED", task
    message = "".join(p.text for p in task.status.message.parts)
    assert message.startswith(f"{reason}: "), message
    meta = MessageToDict(task.metadata)
    assert meta["budgetExceeded"] == reason
    assert meta["usage"]["enforcement"] == "cgroup-v1"
    return meta


async def test_a_task_past_its_timeout_fails_with_timeout(stack: Stack) -> None:
    started = time.monotonic()
    task = await _run(stack, "echo started; sleep 60", {"timeout_seconds": 1.5})
    assert time.monotonic() - started < 30
    meta = _ended_by(task, "timeout")
    assert "1.5 s wall-clock" in "".join(p.text for p in task.status.message.parts)
    assert "started" in artifact_text(task)
    assert meta["budget"]["timeout_seconds"] == 1.5
    event = await _event(stack, "task.failed", task_id=task.id)
    assert event["data"]["exceeded"] == "timeout"
    assert event["data"]["usage"]["output_bytes"] >= len("started")
    session = await _event(stack, "session.exited", session_id=meta["sessionId"])
    assert session["data"]["exceeded"] == "timeout" and session["data"]["signal"] == "KILL"


async def test_a_task_past_its_output_bytes_fails_with_output_limit(stack: Stack) -> None:
    task = await _run(stack, "yes flood", {"output_bytes": 20000, "timeout_seconds": 60})
    meta = _ended_by(task, "output-limit")
    assert meta["usage"]["outputBytes"] == 20000
    assert 15000 < len(artifact_text(task).encode()) <= 20000
    event = await _event(stack, "task.failed", task_id=task.id)
    assert event["data"]["exceeded"] == "output-limit"


async def test_a_memory_hog_task_fails_with_memory_and_the_next_task_runs(stack: Stack) -> None:
    hog = "python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 20))'"
    task = await _run(stack, hog, {"memory_mib": 64, "timeout_seconds": 60})
    meta = _ended_by(task, "memory")
    assert 32 << 20 < int(meta["usage"]["peakMemoryBytes"]) <= 64 << 20
    assert float(meta["usage"]["cpuSeconds"]) > 0
    after = await _run(stack, "echo still here", {})
    assert state_name(after) == "TASK_STATE_COMPLETED" and "still here" in artifact_text(after)
    usage = MessageToDict(after.metadata)["usage"]
    assert usage["outputBytes"] > 0 and "budgetExceeded" not in MessageToDict(after.metadata)


async def test_a_budget_over_the_ceiling_is_refused_naming_the_field(stack: Stack) -> None:
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        msg = text_message("true", metadata={"budget": {"timeout_seconds": 90000}})
        with pytest.raises(sdk_errors.InvalidParamsError) as info:
            await collect(client.send_message(send_request(msg)))
    assert "metadata.budget.timeout_seconds" in str(info.value)
    r = await stack.server.call(
        "POST",
        "/api/v1/tasks",
        stack.alice,
        json={"instance_id": INSTANCE, "command": "true", "budget": {"timeout_seconds": 90000}},
    )
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "body.budget.timeout_seconds"


async def test_an_admin_session_past_its_timeout_ends_with_the_reason(stack: Stack) -> None:
    r = await stack.server.call(
        "POST",
        "/api/v2/admin/sessions",
        stack.alice,
        json={
            "instance_id": INSTANCE,
            "command": ["sleep", "60"],
            "budget": {"timeout_seconds": 1, "pids": 16},
        },
    )
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    event = await _event(stack, "session.exited", session_id=sid)
    assert event["data"]["exceeded"] == "timeout" and event["data"]["signal"] == "KILL"
    assert event["data"]["usage"]["enforcement"] == "cgroup-v1"
    info = (await stack.server.call("GET", f"/api/v2/admin/sessions/{sid}", stack.alice)).json()
    assert "timeout" in info["exit_reason"]
    over = await stack.server.call(
        "POST",
        "/api/v2/admin/sessions",
        stack.alice,
        json={"instance_id": INSTANCE, "budget": {"timeout_seconds": 90000}},
    )
    assert over.status_code == 422
    assert over.json()["errors"][0]["field"] == "body.budget.timeout_seconds"
