"""A2A tasks in the real `isolated` guest of this package (its one shared guest, `conftest.py`),
with the official a2a-sdk client: a memory hog task ends with `memory` (the guest kernel's
cgroup v2, through the task's budget) and a later task still runs; a task that receives a file
part returns an outbox file as an artifact."""

from __future__ import annotations

import os

import pytest
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict

from tests.support.a2a_sdk_client import a2a_client, collect, send_request, state_name
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


def _key(server: ServerProcess, guest: str) -> str:
    out = server.ok(
        "POST",
        "/api/v2/admin/api-keys",
        {"instance_id": guest, "scopes": ["a2a:read", "a2a:invoke"]},
    )
    return str(out["key"])


def _message(text: str, budget: dict[str, float] | None = None, **files: bytes) -> pb.Message:
    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=f"m-{os.urandom(8).hex()}")
    msg.parts.append(pb.Part(text=text))
    for name, data in files.items():
        msg.parts.append(pb.Part(raw=data, filename=name))
    if budget:
        msg.metadata.update({"budget": budget})
    return msg


async def _run(server: ServerProcess, guest: str, key: str, msg: pb.Message) -> pb.Task:
    url = f"{server.url}/agents/{guest}"
    async with a2a_client(url, key, "JSONRPC", streaming=False) as (client, _):
        (ev,) = await collect(client.send_message(send_request(msg)))
        return ev.task


async def test_a_memory_hog_task_ends_with_memory_and_a_later_task_runs(
    server: ServerProcess, guest: str
) -> None:
    key = _key(server, guest)
    hog = "python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 20))'"
    task = await _run(server, guest, key, _message(hog, {"memory_mib": 48, "timeout_seconds": 300}))
    assert state_name(task) == "TASK_STATE_FAILED", task.status
    message = "".join(p.text for p in task.status.message.parts)
    assert message.startswith("memory: "), message
    meta = MessageToDict(task.metadata)
    assert meta["budgetExceeded"] == "memory"
    assert meta["usage"]["enforcement"] == "cgroup-v2"
    assert int(meta["usage"]["peakMemoryBytes"]) <= 48 << 20
    events = server.ok("GET", f"/api/v1/events?type=task.failed&task_id={task.id}")["items"]
    assert events and events[-1]["data"]["exceeded"] == "memory"
    later = await _run(server, guest, key, _message("echo still here"))
    assert state_name(later) == "TASK_STATE_COMPLETED", later.status
    assert "still here" in "".join(p.text for a in later.artifacts for p in a.parts)


async def test_a_task_with_a_file_part_returns_an_outbox_file(
    server: ServerProcess, guest: str
) -> None:
    key = _key(server, guest)
    text = 'id -un > who; tr a-z A-Z < note.txt > "$A2A_OUTBOX/shout.txt"; cat who'
    task = await _run(server, guest, key, _message(text, **{"note.txt": b"from the caller\n"}))
    assert state_name(task) == "TASK_STATE_COMPLETED", task.status
    (art,) = [a for a in task.artifacts if a.artifact_id == "outbox/shout.txt"]
    assert art.parts[0].raw == b"FROM THE CALLER\n"
    assert "agent" in "".join(p.text for a in task.artifacts for p in a.parts if p.text)
