"""The A2A surface end to end: a real sandbox-server process, a real host-side agent-client
(PTY sessions over the mutual-TLS agent link) and the official a2a-sdk client over both
bindings, with the card's signature verified against the agent's JWKS."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver
from a2a.client.errors import AgentCardResolutionError
from a2a.types import a2a_pb2 as pb
from a2a.utils import errors as sdk_errors
from a2a.utils.signing import InvalidSignaturesError
from aiohttp import web
from google.protobuf.json_format import ParseDict

from tests.integration.a2a.conftest import GREET_SKILL, INSTANCE, Stack
from tests.support.a2a_sdk_client import (
    BINDINGS,
    a2a_client,
    artifact_text,
    collect,
    data_message,
    jwks_verifier,
    send_request,
    state_name,
    text_message,
)
from tests.support.async_processes import free_port

V = {"A2A-Version": "1.0"}
TICKS = "for i in 1 2 3 4; do echo tick $i; sleep 0.4; done"


async def _send(client: Any, text: str, **kw: Any) -> pb.Task:
    (ev,) = await collect(client.send_message(send_request(text_message(text), **kw)))
    return ev.task


async def _until(client: Any, task_id: str, *states: str, seconds: float = 20) -> pb.Task:
    deadline = time.monotonic() + seconds
    while True:
        task = await client.get_task(pb.GetTaskRequest(id=task_id))
        if state_name(task) in states or time.monotonic() > deadline:
            return task
        await asyncio.sleep(0.1)


# ---- discovery ------------------------------------------------------------------------------
async def test_card_resolves_with_signature_verification(stack: Stack) -> None:
    for binding in BINDINGS:
        async with a2a_client(stack.url, stack.key, binding) as (_, card):
            assert card.name == f"sandbox {INSTANCE}"
            assert {s.id for s in card.skills} == {"shell", "greet"}
            assert card.capabilities.streaming and card.capabilities.push_notifications
    async with httpx.AsyncClient() as http:
        raw = await http.get(stack.url + "/.well-known/agent-card.json")
        assert raw.headers["ETag"] and raw.headers["Last-Modified"]
        assert "max-age=" in raw.headers["Cache-Control"]
        jwks = (await http.get(stack.url + "/.well-known/jwks.json")).json()
    assert jwks["keys"][0]["kty"] == "OKP" and jwks["keys"][0]["crv"] == "Ed25519"


BAD_DECLARATIONS = [
    ({"skills": [{"id": "x", "name": "X"}]}, "body.skills.0.description"),
    ({"skills": [GREET_SKILL, GREET_SKILL]}, "body.skills"),
    ({"skills": [{**GREET_SKILL, "runner": []}]}, "body.skills.0.runner"),
    ({"skills": [{**GREET_SKILL, "runs": ["x"]}]}, "body.skills.0.runs"),  # an unknown key
    ({"skills": [{**GREET_SKILL, "input_schema": {"type": 7}}]}, "body.skills.0.input_schema"),
    ({"task_runner": {"argv": []}}, "body.task_runner.argv"),
    ({"task_runner": {"env": {"1BAD": "v"}}}, "body.task_runner.env"),
    ({"budgets": {"defaults": {"memory_mib": 2}}}, "body.budgets.defaults.memory_mib"),
]


async def test_registration_declares_skills_and_runner_and_names_a_bad_field(
    stack: Stack,
) -> None:
    """A host instance declares its skills and task runner when it is registered, the way a
    user does; a bad declaration is a 422 naming the field and records nothing."""
    path = "/api/v2/admin/agents/host-instances"
    for extra, field in BAD_DECLARATIONS:
        r = await stack.server.call(
            "POST", path, stack.alice, json={"instance_id": "decl", **extra}
        )
        assert r.status_code == 422, (extra, r.text)
        assert field in [e["field"] for e in r.json()["errors"]], (extra, r.json())
        assert (await stack.server.call("GET", "/api/v2/admin/agents/decl")).status_code == 404
    # `runner`, as a loadout spells it (`command`, the first spelling, is read the same)
    lint = {"id": "lint", "name": "Lint", "description": "Runs the linter", "runner": ["true"]}
    body = {
        "instance_id": "decl",
        "skills": [lint],
        "task_runner": {"argv": ["sh", "-c", "{text}"]},
    }
    r = await stack.server.call("POST", path, stack.alice, json=body)
    assert r.status_code == 201, r.text
    async with httpx.AsyncClient() as http:
        card = await http.get(stack.server.agent_url("decl") + "/.well-known/agent-card.json")
    assert card.status_code == 200, card.text
    assert {s["id"] for s in card.json()["skills"]} == {"shell", "lint"}


async def test_tampered_card_or_wrong_key_is_rejected(stack: Stack) -> None:
    async with httpx.AsyncClient() as http:
        card = (await http.get(stack.url + "/.well-known/agent-card.json")).json()
        jwks = (await http.get(stack.url + "/.well-known/jwks.json")).json()
    tampered = {
        **card,
        "supportedInterfaces": [
            {**i, "url": "https://evil.example/agents/x"} for i in card["supportedInterfaces"]
        ],
    }
    with pytest.raises(InvalidSignaturesError):
        jwks_verifier(jwks)(ParseDict(tampered, pb.AgentCard()))
    # a second agent has its own key, which does not verify the first one's card
    from tests.support.async_processes import AgentProc

    other = AgentProc(stack.server, "a2a-2", stack.agent.tmp)
    await other.enroll_and_start(stack.alice)
    try:
        async with httpx.AsyncClient() as http:
            other_jwks = (
                await http.get(stack.server.agent_url("a2a-2") + "/.well-known/jwks.json")
            ).json()
            wrong = {"keys": [{**other_jwks["keys"][0], "kid": jwks["keys"][0]["kid"]}]}
            resolver = A2ACardResolver(http, stack.url)
            with pytest.raises(InvalidSignaturesError):
                await resolver.get_agent_card(signature_verifier=jwks_verifier(wrong))
            # the right key resolves
            await resolver.get_agent_card(signature_verifier=jwks_verifier(jwks))
            with pytest.raises(AgentCardResolutionError):
                await A2ACardResolver(http, stack.server.agent_url("nope")).get_agent_card()
    finally:
        await other.stop()


# ---- messages and tasks ---------------------------------------------------------------------
@pytest.mark.parametrize("binding", BINDINGS)
async def test_send_blocking_and_return_immediately(stack: Stack, binding: str) -> None:
    async with a2a_client(stack.url, stack.key, binding, streaming=False) as (client, _):
        task = await _send(client, "echo hello from $(basename $SHELL)")
        assert state_name(task) == "TASK_STATE_COMPLETED"
        assert "hello from" in artifact_text(task)
        assert task.metadata["exitCode"] == 0 and task.metadata["sessionId"]
        quick = await _send(client, "sleep 2; echo late", return_immediately=True)
        assert state_name(quick) in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
        done = await _until(client, quick.id, "TASK_STATE_COMPLETED")
        assert artifact_text(done).strip() == "late"
        failed = await _send(client, "echo oops >&2; exit 3")
        assert state_name(failed) == "TASK_STATE_FAILED" and failed.metadata["exitCode"] == 3
        greeted = await collect(
            client.send_message(send_request(data_message({"name": "Ada"}, "greet")))
        )
        assert artifact_text(greeted[0].task).strip() == "hello Ada"


async def test_a_secret_printed_slowly_stays_out_of_the_artifact_and_the_database(
    stack: Stack,
) -> None:
    # One character per write, 0.15 s apart: right after other output, and after a 0.3 s pause.
    secret = f"aaab-slow-{time.time_ns()}"
    r = await stack.server.call(
        "PUT",
        "/api/v2/admin/secrets/SLOW_SECRET",
        json={"value": secret, "instances": [INSTANCE], "env_name": "SLOW_SECRET"},
    )
    assert r.status_code in (200, 201), r.text
    script = (
        'slow() { sleep "$1"; s="$SLOW_SECRET"; '
        'for ((i=0; i<${#s}; i++)); do printf %s "${s:i:1}"; sleep 0.15; done; }; '
        "echo start; slow 0; echo; slow 0.3; echo; echo done"
    )
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        task = await _send(client, script, return_immediately=True)
        done = await _until(client, task.id, "TASK_STATE_COMPLETED", seconds=60)
    text = artifact_text(done)
    assert state_name(done) == "TASK_STATE_COMPLETED"
    mask = "*" * len(secret)
    assert text.replace("\r\n", "\n") == f"start\n{mask}\n{mask}\ndone\n"
    data = stack.server.data_dir
    assert not [f for f in data.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]


@pytest.mark.parametrize("binding", BINDINGS)
async def test_stream_events_arrive_while_the_command_runs(stack: Stack, binding: str) -> None:
    async with a2a_client(stack.url, stack.key, binding) as (client, _):
        seen: list[tuple[float, pb.StreamResponse]] = []
        async for ev in client.send_message(send_request(text_message(TICKS))):
            seen.append((time.monotonic(), ev))
    assert seen[0][1].HasField("task")
    chunks = [(t, ev.artifact_update) for t, ev in seen if ev.HasField("artifact_update")]
    text = "".join(a.artifact.parts[0].text for _, a in chunks)
    assert [line for line in text.splitlines() if line] == [f"tick {i}" for i in range(1, 5)]
    assert len(chunks) >= 3, "output arrived in one lump, not while it was written"
    end = seen[-1][0]
    assert end - chunks[0][0] > 0.8  # the first chunk came long before the end
    assert chunks[1][0] - chunks[0][0] > 0.2  # and chunks came apart, as written
    assert seen[-1][1].status_update.status.state == pb.TaskState.TASK_STATE_COMPLETED
    states = [ev.status_update.status.state for _, ev in seen if ev.HasField("status_update")]
    assert pb.TaskState.TASK_STATE_WORKING in states


@pytest.mark.parametrize("binding", BINDINGS)
async def test_get_list_cancel_subscribe(stack: Stack, binding: str) -> None:
    async with (
        a2a_client(stack.url, stack.key, binding) as (client, _),
        a2a_client(stack.url, stack.key, binding, streaming=False) as (plain, _),
    ):
        ctx = f"ctx-{binding}"
        first = await _send(plain, "echo one")
        msg = text_message("echo two", context_id=ctx)
        (second,) = await collect(plain.send_message(send_request(msg)))
        assert second.task.context_id == ctx
        got = await plain.get_task(pb.GetTaskRequest(id=first.id, history_length=1))
        assert len(got.history) == 1 and got.history[0].role == pb.Role.ROLE_AGENT
        full = await plain.get_task(pb.GetTaskRequest(id=first.id))
        assert [h.role for h in full.history] == [pb.Role.ROLE_USER, pb.Role.ROLE_AGENT]
        by_ctx = await plain.list_tasks(pb.ListTasksRequest(context_id=ctx))
        assert [t.id for t in by_ctx.tasks] == [second.task.id]
        page = await plain.list_tasks(pb.ListTasksRequest(page_size=1))
        assert len(page.tasks) == 1 and page.next_page_token and page.total_size >= 2
        nxt = await plain.list_tasks(
            pb.ListTasksRequest(page_size=1, page_token=page.next_page_token)
        )
        assert nxt.tasks[0].id != page.tasks[0].id
        # a long sleep: subscribe mid-run, then cancel it
        sleeper = await _send(plain, "echo started; sleep 60; echo never", return_immediately=True)
        await _until(plain, sleeper.id, "TASK_STATE_WORKING")
        sub = client.subscribe(pb.SubscribeToTaskRequest(id=sleeper.id)).__aiter__()
        head = await sub.__anext__()
        assert head.task.id == sleeper.id and state_name(head.task) == "TASK_STATE_WORKING"
        t0 = time.monotonic()
        canceled = await plain.cancel_task(pb.CancelTaskRequest(id=sleeper.id))
        assert state_name(canceled) == "TASK_STATE_CANCELED"
        assert time.monotonic() - t0 < 10
        tail = [ev async for ev in sub]
        assert tail[-1].status_update.status.state == pb.TaskState.TASK_STATE_CANCELED
        assert "never" not in artifact_text(await plain.get_task(pb.GetTaskRequest(id=sleeper.id)))
        working = await plain.list_tasks(
            pb.ListTasksRequest(status=pb.TaskState.TASK_STATE_CANCELED)
        )
        assert sleeper.id in [t.id for t in working.tasks]
        with pytest.raises(sdk_errors.TaskNotCancelableError):
            await plain.cancel_task(pb.CancelTaskRequest(id=sleeper.id))


@pytest.mark.parametrize("binding", BINDINGS)
async def test_hitl_prompt_answer_completes(stack: Stack, binding: str) -> None:
    cmd = 'read -p \'Continue? (y/n) \' a; echo "answer=$a"; test "$a" = y'
    async with a2a_client(stack.url, stack.key, binding, streaming=False) as (client, _):
        task = await _send(client, cmd)
        assert state_name(task) == "TASK_STATE_INPUT_REQUIRED"
        assert "Continue? (y/n)" in task.status.message.parts[0].text
        answer = text_message("y", task_id=task.id, context_id=task.context_id)
        (ev,) = await collect(client.send_message(send_request(answer)))
        assert state_name(ev.task) == "TASK_STATE_COMPLETED"
        assert "answer=y" in artifact_text(ev.task)


# ---- rejections -----------------------------------------------------------------------------
@pytest.mark.parametrize("binding", BINDINGS)
async def test_schema_invalid_data_is_rejected(stack: Stack, binding: str) -> None:
    async with a2a_client(stack.url, stack.key, binding, streaming=False) as (client, _):
        (ev,) = await collect(
            client.send_message(send_request(data_message({"name": ""}, "greet")))
        )
        assert state_name(ev.task) == "TASK_STATE_REJECTED"
        assert "data.name" in ev.task.status.message.parts[0].text


async def _raw(stack: Stack, method: str, path: str, key: str | None, **kw: Any) -> httpx.Response:
    headers = {**kw.pop("headers", V)}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient() as http:
        return await http.request(method, stack.server.base + path, headers=headers, **kw)


async def test_refusals_on_the_wire(stack: Stack) -> None:
    rpc = {"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}}
    base = f"/agents/{INSTANCE}"
    # unknown instance: 404 / TaskNotFound
    r = await _raw(stack, "GET", "/agents/nope/tasks", stack.key)
    assert r.status_code == 404 and r.json()["error"]["details"][0]["reason"] == "TASK_NOT_FOUND"
    r = await _raw(stack, "POST", "/agents/nope", stack.server.admin, json=rpc)
    assert r.json()["error"]["code"] == -32001
    # missing A2A-Version
    r = await _raw(stack, "POST", base, stack.key, json=rpc, headers={})
    assert r.json()["error"]["code"] == -32009
    r = await _raw(stack, "GET", base + "/tasks", stack.key, headers={})
    assert r.status_code == 400
    assert r.json()["error"]["details"][0]["reason"] == "VERSION_NOT_SUPPORTED"
    # no key, a key with the wrong scope
    r = await _raw(stack, "POST", base, None, json=rpc)
    assert r.status_code == 401
    reader = await stack.server.api_key(INSTANCE, ["a2a:read"], stack.alice)
    send = {
        **rpc,
        "method": "SendMessage",
        "params": {
            "message": {"messageId": "r1", "role": "ROLE_USER", "parts": [{"text": "echo no"}]}
        },
    }
    r = await _raw(stack, "POST", base, reader, json=send)
    assert r.status_code == 403 and "a2a:invoke" in r.json()["error"]["message"]
    r = await _raw(stack, "POST", base + "/message:send", reader, json=send["params"])
    assert r.status_code == 403
    async with a2a_client(stack.url, reader, "HTTP+JSON", streaming=False) as (client, _):
        with pytest.raises(Exception, match="403"):
            await _send(client, "echo no")
        assert (await client.list_tasks(pb.ListTasksRequest())).total_size >= 0


@pytest.mark.parametrize(
    "stack", [{"SANDBOX_TASK_MAX_RUNNING": 1, "SANDBOX_TASK_MAX_PENDING": 0}], indirect=True
)
async def test_over_quota_submit_is_rejected(stack: Stack) -> None:
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        busy = await _send(client, "sleep 30", return_immediately=True)
        await _until(client, busy.id, "TASK_STATE_WORKING")
        refused = await _send(client, "echo later")
        assert state_name(refused) == "TASK_STATE_REJECTED"
        assert "quota" in refused.status.message.parts[0].text
        r = await stack.server.call(
            "POST", "/api/v1/tasks", stack.alice, json={"instance_id": INSTANCE, "command": "true"}
        )
        assert r.status_code == 429 and r.headers["Retry-After"]
        await client.cancel_task(pb.CancelTaskRequest(id=busy.id))


# ---- restart --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
async def test_server_restart_during_a_task(stack: Stack, how: int) -> None:
    script = "for i in $(seq 1 8); do echo line $i; sleep 0.5; done"
    async with a2a_client(stack.url, stack.key, "HTTP+JSON", streaming=False) as (client, _):
        task = await _send(client, script, return_immediately=True)
        for _ in range(100):
            got = await client.get_task(pb.GetTaskRequest(id=task.id))
            if "line 2" in artifact_text(got):
                break
            await asyncio.sleep(0.1)
    await stack.server.stop(how)
    await asyncio.sleep(1.0)  # the run goes on in the agent while the server is down
    await stack.server.start()
    await stack.agent.wait_connected()
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        done = await _until(
            client, task.id, "TASK_STATE_COMPLETED", "TASK_STATE_FAILED", seconds=30
        )
    assert state_name(done) == "TASK_STATE_COMPLETED", done.status.message
    lines = [x for x in artifact_text(done).splitlines() if x.strip()]
    assert lines == [f"line {i}" for i in range(1, 9)]
    r = await stack.server.call("GET", f"/api/v2/admin/missions/{task.id}")
    ends = [t for t in r.json()["transitions"] if t["to_state"] in ("completed", "failed")]
    assert len(ends) == 1
    assert len(r.json()["runs"]) == 1  # re-adopted, not restarted


# ---- push notifications ---------------------------------------------------------------------
async def _receiver() -> tuple[str, list[tuple[dict[str, str], dict[str, Any]]], web.AppRunner]:
    got: list[tuple[dict[str, str], dict[str, Any]]] = []

    async def hook(request: web.Request) -> web.Response:
        got.append((dict(request.headers), await request.json()))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}/hook", got, runner


@pytest.mark.parametrize("binding", BINDINGS)
async def test_push_notifications(stack: Stack, binding: str) -> None:
    url, got, runner = await _receiver()
    try:
        async with a2a_client(stack.url, stack.key, binding, streaming=False) as (client, _):
            task = await _send(client, "sleep 1; echo pushed", return_immediately=True)
            cfg = pb.TaskPushNotificationConfig(task_id=task.id, url=url, token=f"tok-{binding}")
            made = await client.create_task_push_notification_config(cfg)
            assert made.id and made.url == url
            await _until(client, task.id, "TASK_STATE_COMPLETED")
            for _ in range(100):
                if any(_state(b) == "TASK_STATE_COMPLETED" for _, b in got):
                    break
                await asyncio.sleep(0.05)
        assert any(_state(b) == "TASK_STATE_COMPLETED" for _, b in got)
        assert all(h["X-A2A-Notification-Token"] == f"tok-{binding}" for h, _ in got)
        text = "".join(
            p["text"]
            for _, b in got
            if "artifactUpdate" in b
            for p in b["artifactUpdate"]["artifact"]["parts"]
        )
        assert "pushed" in text
    finally:
        await runner.cleanup()


def _state(body: dict[str, Any]) -> str:
    return str(body.get("statusUpdate", {}).get("status", {}).get("state", ""))


@pytest.mark.parametrize("stack", [{"SANDBOX_PUSH_MAX_ATTEMPTS": 3}], indirect=True)
async def test_dead_push_receiver_is_recorded_after_retries(stack: Stack) -> None:
    dead = f"http://127.0.0.1:{free_port()}/hook"
    params = {
        "message": {"messageId": "dead-1", "role": "ROLE_USER", "parts": [{"text": "echo x"}]},
        "configuration": {"taskPushNotificationConfig": {"url": dead, "token": "t"}},
    }
    r = await _raw(stack, "POST", f"/agents/{INSTANCE}/message:send", stack.key, json=params)
    task_id = r.json()["task"]["id"]
    for _ in range(100):
        ev = await stack.server.call(
            "GET", f"/api/v1/events?task_id={task_id}&type=task.push_failed"
        )
        items = ev.json()["items"]
        if items:
            break
        await asyncio.sleep(0.1)
    assert items, "no task.push_failed event"
    assert items[0]["data"]["attempts"] == 3 and items[0]["data"]["url"] == dead
    assert items[0]["data"]["error"] == "delivery failed (no HTTP answer)"


# ---- the deprecated v1 API on the same store ------------------------------------------------
async def test_v1_api_runs_on_the_same_tasks(stack: Stack) -> None:
    r = await stack.server.call(
        "POST", "/api/v1/tasks", stack.alice, json={"instance_id": INSTANCE, "command": "echo v1"}
    )
    assert r.status_code == 201 and r.headers["Deprecation"] and r.headers["Sunset"]
    assert "successor-version" in r.headers["Link"]
    tid = r.json()["id"]
    logs = await stack.server.call("GET", f"/api/v1/tasks/{tid}/logs", stack.alice)
    assert "v1" in logs.text and "event: end" in logs.text
    async with a2a_client(stack.url, stack.key, "JSONRPC", streaming=False) as (client, _):
        seen = await client.get_task(pb.GetTaskRequest(id=tid))
        assert state_name(seen) == "TASK_STATE_COMPLETED" and "v1" in artifact_text(seen)
    assert (
        json.loads((await stack.server.call("GET", f"/api/v1/tasks/{tid}", stack.alice)).text)[
            "output"
        ].strip()
        == "v1"
    )
