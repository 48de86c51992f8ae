"""A2A file parts on a real host agent, with the official a2a-sdk client: raw parts are written
into the task's working directory before the run; what the run leaves in its outbox comes back
as artifacts with file parts — raw bytes for a small file, a download URL under the admin
files API for a large one (which serves the same bytes); bad names, oversized parts and URL
parts are refused naming the field."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import pytest
from a2a.types import a2a_pb2 as pb
from a2a.utils import errors as sdk_errors
from google.protobuf.json_format import MessageToDict

from tests.integration.a2a.conftest import Stack
from tests.support.a2a_sdk_client import a2a_client, collect, send_request, state_name

pytestmark = pytest.mark.timeout(180)

LARGE = 300 * 1024  # over the 256 KiB inline limit (SANDBOX_TASK_FILE_INLINE_BYTES)


def _message(text: str, files: dict[str, bytes]) -> pb.Message:
    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=f"m-{os.urandom(8).hex()}")
    msg.parts.append(pb.Part(text=text))
    for name, data in files.items():
        msg.parts.append(pb.Part(raw=data, filename=name, media_type="text/plain"))
    return msg


async def _send(stack: Stack, msg: pb.Message) -> pb.Task:
    async with a2a_client(stack.url, stack.key, "HTTP+JSON", streaming=False) as (client, _):
        (ev,) = await collect(client.send_message(send_request(msg)))
        return ev.task


def _files(task: pb.Task) -> dict[str, pb.Part]:
    out = {}
    for art in task.artifacts:
        if art.artifact_id.startswith("outbox/"):
            (part,) = art.parts
            out[art.name] = part
    return out


async def test_file_parts_in_and_outbox_files_back(stack: Stack) -> None:
    big = os.urandom(LARGE)
    script = (
        'test "$PWD" = "$A2A_WORKDIR" && '
        'tr a-z A-Z < in.txt > "$A2A_OUTBOX/upper.txt" && '
        'cp sub/data.bin "$A2A_OUTBOX/copy.bin" && '
        'mkdir "$A2A_OUTBOX/skipped" && echo done'
    )
    task = await _send(stack, _message(script, {"in.txt": b"hello files\n", "sub/data.bin": big}))
    assert state_name(task) == "TASK_STATE_COMPLETED", task.status
    files = _files(task)
    assert set(files) == {"upper.txt", "copy.bin"}  # regular files only
    assert files["upper.txt"].raw == b"HELLO FILES\n"
    assert files["upper.txt"].media_type == "text/plain"
    url = files["copy.bin"].url
    assert url and "/api/v2/admin/instances/" in url and "/outbox/copy.bin" in url
    r = await stack.server.call("GET", url.removeprefix(stack.server.base), stack.alice)
    assert (
        r.status_code == 200 and hashlib.sha256(r.content).digest() == hashlib.sha256(big).digest()
    )
    meta = MessageToDict(task.metadata)
    assert "outboxError" not in meta
    # the stored task (read back) carries the same artifacts
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        again = await client.get_task(pb.GetTaskRequest(id=task.id))
    assert _files(again)["upper.txt"].raw == b"HELLO FILES\n"


async def test_a_streamed_task_gets_its_outbox_as_artifact_updates(stack: Stack) -> None:
    async with a2a_client(stack.url, stack.key, "JSONRPC") as (client, _):
        msg = _message('echo report > "$A2A_OUTBOX/report.txt"', {})
        events = await collect(client.send_message(send_request(msg)))
    updates = [
        ev.artifact_update
        for ev in events
        if ev.HasField("artifact_update")
        and ev.artifact_update.artifact.artifact_id == "outbox/report.txt"
    ]
    assert len(updates) == 1 and updates[0].artifact.parts[0].raw == b"report\n"


BAD: list[tuple[dict[str, Any], str]] = [
    ({"raw": "aGk=", "filename": "../escape"}, "message.parts[1].filename"),
    ({"raw": "aGk=", "filename": "/etc/passwd"}, "message.parts[1].filename"),
    ({"raw": "aGk=", "filename": "outbox/x"}, "message.parts[1].filename"),
]


@pytest.mark.parametrize(("part", "field"), BAD)
async def test_bad_file_names_are_refused_naming_the_field(
    stack: Stack, part: dict[str, Any], field: str
) -> None:
    body = {
        "message": {
            "messageId": f"m-{os.urandom(8).hex()}",
            "role": "ROLE_USER",
            "parts": [{"text": "true"}, part],
        }
    }
    r = await stack.server.call(
        "POST",
        f"/agents/{stack.agent.instance_id}/message:send",
        stack.key,
        json=body,
        headers={"A2A-Version": "1.0"},
    )
    assert r.status_code == 400, r.text
    assert field in r.text


async def test_url_parts_and_oversized_parts_are_refused(stack: Stack) -> None:
    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=f"m-{os.urandom(8).hex()}")
    msg.parts.append(pb.Part(text="true"))
    msg.parts.append(pb.Part(url="https://example.com/x.bin", filename="x.bin"))
    with pytest.raises(sdk_errors.ContentTypeNotSupportedError) as info:
        await _send(stack, msg)
    assert "egress" in str(info.value)


@pytest.mark.parametrize("stack", [{"SANDBOX_TASK_FILE_MAX_BYTES": "1000"}], indirect=True)
async def test_a_part_over_the_size_limit_is_refused(stack: Stack) -> None:
    with pytest.raises(sdk_errors.InvalidParamsError) as info:
        await _send(stack, _message("true", {"big.bin": b"x" * 1001}))
    assert "SANDBOX_TASK_FILE_MAX_BYTES" in str(info.value)


async def test_the_agent_makes_a_runs_directories_as_it_opens_it(stack: Stack) -> None:
    """Without file parts the agent makes the working directory and outbox as it opens the
    run (no mkdir stream, no `instance.files.mkdir` row); with file parts a mkdir comes first,
    as the audit log shows."""
    script = 'test -d "$A2A_OUTBOX" && test "$PWD" = "$A2A_WORKDIR" && echo ok > "$A2A_OUTBOX/r"'
    plain = await _send(stack, _message(script, {}))
    assert state_name(plain) == "TASK_STATE_COMPLETED", plain.status
    assert _files(plain)["r"].raw == b"ok\n"
    with_part = await _send(stack, _message("cat in.txt", {"in.txt": b"x"}))
    assert state_name(with_part) == "TASK_STATE_COMPLETED", with_part.status

    async def mkdir_paths() -> list[str]:
        r = await stack.server.call(
            "GET", "/api/v2/admin/audit?actor=system:tasks&limit=1000", stack.server.admin
        )
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        return [e["detail"]["path"] for e in items if e["action"] == "instance.files.mkdir"]

    deadline = asyncio.get_running_loop().time() + 15
    while not any(with_part.id in p for p in await mkdir_paths()):  # written behind
        assert asyncio.get_running_loop().time() < deadline, await mkdir_paths()
        await asyncio.sleep(0.2)
    assert not [p for p in await mkdir_paths() if plain.id in p]


async def test_the_outbox_comes_back_with_the_runs_exit(stack: Stack) -> None:
    """The agent lists the outbox as the run ends (`SessionExit.listing`): a task whose outbox
    stays empty sends no stream to the agent at all (before: a listing stream after every
    run), and one that leaves a small file has only that file's read."""

    async def streams_out() -> float:
        r = await stack.server.call("GET", "/metrics", stack.server.admin)
        assert r.status_code == 200, r.text
        line = 'sandbox_grpc_messages_total{direction="out",kind="stream"} '
        found = [x for x in r.text.splitlines() if x.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    before = await streams_out()
    empty = await _send(stack, _message("true", {}))
    assert state_name(empty) == "TASK_STATE_COMPLETED", empty.status
    assert _files(empty) == {}
    assert await streams_out() == before
    one = await _send(stack, _message('echo hi > "$A2A_OUTBOX/o.txt"', {}))
    assert state_name(one) == "TASK_STATE_COMPLETED", one.status
    assert _files(one)["o.txt"].raw == b"hi\n"
    # the read's open, and nothing of a listing stream (which sent two)
    assert await streams_out() - before == 1
