"""Push notifications (a loopback receiver, a dead one), the deprecated v1 task API and the
admin missions roll-up, on the in-process server with the fake session layer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from agentic_sandbox.broker.observability.events import EventFilter
from agentic_sandbox.broker.tasks import Caller, TaskState
from tests.support.inproc_server import free_port
from tests.unit.a2a.conftest import Agent

V = {"A2A-Version": "1.0"}


class Receiver:
    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.arrived = asyncio.Event()
        self.fail_first = 0

    async def handle(self, request: web.Request) -> web.Response:
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503)
        self.got.append((dict(request.headers), await request.json()))
        self.arrived.set()
        return web.Response(status=204)


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, Receiver]]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/hook", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/hook", rec
    finally:
        await runner.cleanup()


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 10) -> None:
    """Poll `check` until it holds (a deadline, not a sleep that is hoped to be enough)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.02)


async def _send(agent: Agent, key: str, text: str, push: dict[str, Any] | None = None) -> Any:
    params: dict[str, Any] = {
        "message": {
            "messageId": f"m-{text}-{id(push)}",
            "role": "ROLE_USER",
            "parts": [{"text": text}],
        },
        "configuration": {"returnImmediately": True},
    }
    if push:
        params["configuration"]["taskPushNotificationConfig"] = push
    async with httpx.AsyncClient() as http:
        r = await http.post(
            agent.url + "/message:send",
            json=params,
            headers={**V, "Authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200, r.text
    return r.json()["task"]


async def test_push_reaches_the_receiver_with_the_token(
    agent: Agent, receiver: tuple[str, Receiver]
) -> None:
    url, rec = receiver
    rec.fail_first = 1  # the first POST fails: it is retried
    key = await agent.key(["a2a:invoke"])
    task = await _send(agent, key, "echo hello", {"url": url, "token": "secret-tok"})
    for _ in range(300):
        states = [b["statusUpdate"]["status"]["state"] for _, b in rec.got if "statusUpdate" in b]
        if "TASK_STATE_COMPLETED" in states:
            break
        await asyncio.sleep(0.01)
    assert "TASK_STATE_COMPLETED" in states
    assert all(h.get("X-A2A-Notification-Token") == "secret-tok" for h, _ in rec.got)
    assert all(
        b.get("statusUpdate", b.get("artifactUpdate"))["taskId"] == task["id"] for _, b in rec.got
    )
    kinds = [next(iter(b)) for _, b in rec.got]
    assert "artifactUpdate" in kinds
    # the token is stored sealed
    await agent.svc.events.flush()
    db = agent.svc.settings.data_dir / "sandbox.db"
    assert all(b"secret-tok" not in f.read_bytes() for f in db.parent.glob("sandbox.db*"))


@pytest.mark.parametrize("agent", [{"push_max_attempts": 3}], indirect=True)
async def test_a_dead_receiver_ends_in_a_recorded_failure(agent: Agent) -> None:
    dead = f"http://127.0.0.1:{free_port()}/hook"
    key = await agent.key(["a2a:invoke"])
    task = await _send(agent, key, "echo hello", {"url": dead, "token": "t"})
    flt = EventFilter(task_id=task["id"], types=("task.push_failed",))
    for _ in range(300):
        found = await agent.svc.events.query(0, 50, flt)
        if found:
            break
        await asyncio.sleep(0.02)
    assert found, "no task.push_failed event"
    data = found[0].data
    assert data["attempts"] == 3 and data["url"] == dead
    # a fixed text: no address, port or OS error (which would make a port-scan oracle)
    assert data["error"] == "delivery failed (no HTTP answer)"
    audit = await agent.svc.audit.query(
        subject_type="task", subject_id=task["id"], outcome="failed"
    )
    assert audit and audit[0].action == "task.push"
    assert audit[0].cause == "delivery failed (no HTTP answer)"


async def test_push_url_is_checked(agent: Agent) -> None:
    key = await agent.key(["a2a:invoke"])
    async with httpx.AsyncClient() as http:
        r = await http.post(
            agent.url + "/message:send",
            json={
                "message": {
                    "messageId": "p1",
                    "role": "ROLE_USER",
                    "parts": [{"text": "echo hello"}],
                },
                "configuration": {"taskPushNotificationConfig": {"url": "file:///etc/passwd"}},
            },
            headers={**V, "Authorization": f"Bearer {key}"},
        )
    assert r.status_code == 400
    assert r.json()["error"]["details"][1]["fieldViolations"][0]["field"] == "url"


# ---- v1 -------------------------------------------------------------------------------------
async def _v1(
    agent: Agent, method: str, path: str, token: str | None = None, **kw: Any
) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.request(
            method,
            agent.base + path,
            headers={"Authorization": f"Bearer {token or agent.admin}"},
            **kw,
        )


def _deprecated(resp: httpx.Response) -> None:
    assert resp.headers["Deprecation"].startswith("@")
    assert resp.headers["Sunset"].endswith("GMT")
    assert 'rel="deprecation"' in resp.headers["Link"]


async def test_v1_submit_get_list_logs_cancel(agent: Agent) -> None:
    alice = await agent.token("alice")
    r = await _v1(
        agent, "POST", "/api/v1/tasks", alice, json={"instance_id": "vm1", "command": "echo hello"}
    )
    assert r.status_code == 201, r.text
    _deprecated(r)
    assert 'rel="successor-version"' in r.headers["Link"]
    tid = r.json()["id"]
    for _ in range(100):
        got = await _v1(agent, "GET", f"/api/v1/tasks/{tid}", alice)
        if got.json()["state"] == "completed":
            break
        await asyncio.sleep(0.02)
    body = got.json()
    assert body["state"] == "completed" and body["output"] == "hello\r\n" and body["exit_code"] == 0
    _deprecated(got)
    listed = await _v1(agent, "GET", "/api/v1/tasks?instance_id=vm1&state=completed", alice)
    assert [t["id"] for t in listed.json()["items"]] == [tid]
    _deprecated(listed)
    logs = await _v1(agent, "GET", f"/api/v1/tasks/{tid}/logs", alice)
    assert logs.headers["content-type"].startswith("text/event-stream")
    _deprecated(logs)
    assert "event: output" in logs.text and '"hello\\r\\n"' in logs.text
    assert "event: end" in logs.text
    # a long one: logs stream live, DELETE cancels it
    r = await _v1(
        agent, "POST", "/api/v1/tasks", alice, json={"instance_id": "vm1", "command": "sleep 60"}
    )
    tid2 = r.json()["id"]
    admin = Caller("admin", "token:admin", is_admin=True)
    for _ in range(500):  # cancel a task that runs, not one still waiting for its session
        if (await agent.tasks.get(tid2, admin)).state is TaskState.working:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the long task never started working")
    r = await _v1(agent, "DELETE", f"/api/v1/tasks/{tid2}", alice)
    assert r.status_code == 200 and r.json()["state"] == "canceled"
    _deprecated(r)
    r = await _v1(agent, "DELETE", f"/api/v1/tasks/{tid2}", alice)
    assert r.status_code == 409
    _deprecated(r)
    assert r.headers["content-type"].startswith("application/problem+json")


@pytest.mark.parametrize("agent", [{"task_max_running": 1, "task_max_pending": 0}], indirect=True)
async def test_v1_over_quota_is_429(agent: Agent) -> None:
    alice = await agent.token("alice")
    r = await _v1(
        agent, "POST", "/api/v1/tasks", alice, json={"instance_id": "vm1", "command": "sleep 60"}
    )
    assert r.status_code == 201
    first = r.json()["id"]

    async def first_runs() -> bool:
        got = await _v1(agent, "GET", f"/api/v1/tasks/{first}", alice)
        return bool(got.json()["state"] == "working")

    await _until(first_runs, "the first task is working")
    r = await _v1(
        agent, "POST", "/api/v1/tasks", alice, json={"instance_id": "vm1", "command": "sleep 60"}
    )
    assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0
    _deprecated(r)
    # A2A answers the same refusal with a rejected task
    key = await agent.key(["a2a:invoke"])
    task = await _send(agent, key, "echo hello")
    assert task["status"]["state"] == "TASK_STATE_REJECTED"
    assert "quota" in task["status"]["message"]["parts"][0]["text"]


async def test_v1_validation_and_access(agent: Agent) -> None:
    alice = await agent.token("alice")
    bob = await agent.token("bob")
    r = await _v1(agent, "POST", "/api/v1/tasks", alice, json={"instance_id": "vm1"})
    assert r.status_code == 422 and "command" in r.json()["detail"]
    r = await _v1(
        agent,
        "POST",
        "/api/v1/tasks",
        alice,
        json={"instance_id": "vm1", "command": "x", "nope": 1},
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.nope"
    r = await _v1(agent, "POST", "/api/v1/tasks", bob, json={"instance_id": "vm1", "command": "x"})
    assert r.status_code == 404
    r = await _v1(
        agent, "POST", "/api/v1/tasks", alice, json={"instance_id": "vm1", "command": "echo hello"}
    )
    tid = r.json()["id"]
    assert (await _v1(agent, "GET", f"/api/v1/tasks/{tid}", bob)).status_code == 404
    key = await agent.key(["a2a:read", "a2a:invoke"])
    assert (await _v1(agent, "GET", "/api/v1/tasks", key)).status_code == 403


async def test_missions_roll_up(agent: Agent) -> None:
    alice = await agent.token("alice")
    bob = await agent.token("bob")
    await agent.add_instance("vm2", owner="bob")
    for tok, iid, cmd in (
        (alice, "vm1", "echo hello"),
        (alice, "vm1", "exit 7"),
        (bob, "vm2", "echo hello"),
    ):
        r = await _v1(
            agent, "POST", "/api/v1/tasks", tok, json={"instance_id": iid, "command": cmd}
        )
        assert r.status_code == 201

    async def all_ended() -> bool:
        doc = (await _v1(agent, "GET", "/api/v2/admin/missions?state=completed,failed")).json()
        return len(doc["items"]) == 3

    await _until(all_ended, "the three missions end")
    mine = (await _v1(agent, "GET", "/api/v2/admin/missions", alice)).json()
    assert {m["owner"] for m in mine["items"]} == {"alice"}
    assert mine["totals"] == {"completed": 1, "failed": 1}
    everyone = (await _v1(agent, "GET", "/api/v2/admin/missions?state=completed,failed")).json()
    assert len(everyone["items"]) == 3
    only = (await _v1(agent, "GET", "/api/v2/admin/missions?instance_id=vm2")).json()
    assert [m["owner"] for m in only["items"]] == ["bob"]
    r = await _v1(agent, "GET", "/api/v2/admin/missions?owner=bob", alice)
    assert r.status_code == 403
    one = mine["items"][0]["id"]
    detail = (await _v1(agent, "GET", f"/api/v2/admin/missions/{one}", alice)).json()
    assert [t["to_state"] for t in detail["transitions"]][:2] == ["submitted", "working"]
    assert detail["runs"][0]["session_id"] == detail["session_id"]
    assert (await _v1(agent, "GET", f"/api/v2/admin/missions/{one}", bob)).status_code == 404
    r = await _v1(agent, "GET", "/api/v2/admin/missions?state=bogus", alice)
    assert r.status_code == 422 and r.json()["errors"][0]["field"].startswith("query.state")


async def test_openapi_documents_v1_and_missions(agent: Agent) -> None:
    doc = (await _v1(agent, "GET", "/api/openapi.json")).json()
    paths = doc["paths"]
    assert paths["/api/v1/tasks"]["post"]["deprecated"] is True
    assert "/api/v1/tasks/{task_id}/logs" in paths
    assert "/api/v2/admin/missions" in paths and "/api/v2/admin/missions/{task_id}" in paths
    assert not any(p.startswith("/agents") for p in paths)
    json.dumps(doc)
