"""The A2A surface on the wire (in-process server, fake session layer) with the official
a2a-sdk client over both bindings, plus raw-HTTP checks of what the SDK does not exercise."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver
from a2a.types import a2a_pb2 as pb
from a2a.utils import errors as sdk_errors
from a2a.utils.signing import InvalidSignaturesError
from google.protobuf.json_format import ParseDict

from agentic_sandbox.broker.a2a.card import SKILL_SCHEMAS_EXT, clean_empty
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
from tests.unit.a2a.conftest import Agent

V = {"A2A-Version": "1.0"}


# ---- discovery ------------------------------------------------------------------------------
async def test_card_is_a2a_1_0_signed_and_cacheable(agent: Agent) -> None:
    async with httpx.AsyncClient() as http:
        resp = await http.get(agent.url + "/.well-known/agent-card.json")
        assert resp.status_code == 200
        card = resp.json()
        assert resp.headers["Cache-Control"].startswith("public, max-age=")
        assert resp.headers["ETag"] and resp.headers["Last-Modified"]
        again = await http.get(
            agent.url + "/.well-known/agent-card.json",
            headers={"If-None-Match": resp.headers["ETag"]},
        )
        assert again.status_code == 304
        jwks = (await http.get(agent.url + "/.well-known/jwks.json")).json()
    # A2A 1.0 fields only: the proto parser accepts it with unknown fields refused
    ParseDict(card, pb.AgentCard(), ignore_unknown_fields=False)
    assert clean_empty(card) == card  # no empty strings, lists or objects
    assert [i["protocolBinding"] for i in card["supportedInterfaces"]] == ["JSONRPC", "HTTP+JSON"]
    assert {i["url"] for i in card["supportedInterfaces"]} == {agent.url}
    assert {i["protocolVersion"] for i in card["supportedInterfaces"]} == {"1.0"}
    assert card["capabilities"]["streaming"] and card["capabilities"]["pushNotifications"]
    assert {s["id"] for s in card["skills"]} == {"shell", "greet"}
    schemas = card["capabilities"]["extensions"][0]
    assert schemas["uri"] == SKILL_SCHEMAS_EXT
    assert json.loads(schemas["params"]["schemas"]["greet"])["required"] == ["name"]
    sig = card["signatures"][0]
    header = json.loads(_b64(sig["protected"]))
    assert header == {"alg": "EdDSA", "kid": jwks["keys"][0]["kid"], "typ": "JOSE"}
    # the SDK's verifier accepts it
    jwks_verifier(jwks)(ParseDict(card, pb.AgentCard()))


def _b64(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


async def test_sdk_rejects_a_tampered_card_and_a_wrong_key(agent: Agent) -> None:
    async with httpx.AsyncClient() as http:
        card = (await http.get(agent.url + "/.well-known/agent-card.json")).json()
        jwks = (await http.get(agent.url + "/.well-known/jwks.json")).json()
    verify = jwks_verifier(jwks)
    tampered = json.loads(json.dumps(card))
    tampered["description"] += " (and also mine bitcoin)"
    with pytest.raises(InvalidSignaturesError):
        verify(ParseDict(tampered, pb.AgentCard()))
    # another instance's key does not verify this card
    await agent.add_instance("vm2")
    async with httpx.AsyncClient() as http:
        other = (await http.get(agent.base + "/agents/vm2/.well-known/jwks.json")).json()
    assert other["keys"][0]["kid"] != jwks["keys"][0]["kid"]
    other_keyed = {"keys": [{**other["keys"][0], "kid": jwks["keys"][0]["kid"]}]}
    with pytest.raises(InvalidSignaturesError):
        jwks_verifier(other_keyed)(ParseDict(card, pb.AgentCard()))
    # the resolver path: the SDK refuses the card when the key is wrong
    async with httpx.AsyncClient() as http:
        resolver = A2ACardResolver(http, agent.url)
        with pytest.raises(InvalidSignaturesError):
            await resolver.get_agent_card(signature_verifier=jwks_verifier(other_keyed))


async def test_unknown_instance_card_is_404(agent: Agent) -> None:
    async with httpx.AsyncClient() as http:
        resp = await http.get(agent.base + "/agents/nope/.well-known/agent-card.json")
    assert resp.status_code == 404
    assert resp.headers["content-type"].startswith("application/problem+json")


# ---- the SDK client over both bindings ------------------------------------------------------
@pytest.mark.parametrize("binding", BINDINGS)
async def test_send_blocking_and_return_immediately(agent: Agent, binding: str) -> None:
    key = await agent.key(["a2a:read", "a2a:invoke"])
    async with a2a_client(agent.url, key, binding, streaming=False) as (client, card):
        assert card.name == "sandbox vm1"
        (ev,) = await collect(client.send_message(send_request(text_message("echo hello"))))
        task = ev.task
        assert state_name(task) == "TASK_STATE_COMPLETED"
        assert artifact_text(task) == "hello\r\n"
        assert task.metadata["sessionId"]
        (ev,) = await collect(
            client.send_message(send_request(text_message("sleep 60"), return_immediately=True))
        )
        assert state_name(ev.task) in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
        got = await client.get_task(pb.GetTaskRequest(id=ev.task.id, history_length=0))
        assert len(got.history) == 0


@pytest.mark.parametrize("binding", BINDINGS)
async def test_stream_events_arrive_while_running(agent: Agent, binding: str) -> None:
    key = await agent.key(["a2a:invoke"])
    async with a2a_client(agent.url, key, binding) as (client, _):
        stamps: list[tuple[float, pb.StreamResponse]] = []
        async for ev in client.send_message(send_request(text_message("ticks"))):
            stamps.append((time.monotonic(), ev))
    kinds = [ev.WhichOneof("payload") for _, ev in stamps]
    assert kinds[0] == "task"
    arts = [(t, ev) for t, ev in stamps if ev.HasField("artifact_update")]
    assert "".join(ev.artifact_update.artifact.parts[0].text for _, ev in arts) == (
        "tick 0\r\ntick 1\r\ntick 2\r\n"
    )
    assert arts[-1][0] - arts[0][0] > 0.4  # chunks arrived while the command ran
    assert stamps[-1][1].status_update.status.state == pb.TaskState.TASK_STATE_COMPLETED


@pytest.mark.parametrize("binding", BINDINGS)
async def test_get_list_cancel_subscribe(agent: Agent, binding: str) -> None:
    key = await agent.key(["a2a:read", "a2a:invoke"])
    async with a2a_client(agent.url, key, binding) as (client, _):
        ids = []
        for text in ("echo hello", "echo hello", "exit 7"):
            (ev,) = [
                e
                async for e in client.send_message(send_request(text_message(text)))
                if e.HasField("task")
            ][:1]
            ids.append(ev.task.id)
        await asyncio.sleep(0.3)
        page = await client.list_tasks(pb.ListTasksRequest(page_size=2))
        assert page.total_size == 3 and len(page.tasks) == 2 and page.next_page_token
        rest = await client.list_tasks(
            pb.ListTasksRequest(page_size=2, page_token=page.next_page_token)
        )
        assert len(rest.tasks) == 1 and rest.next_page_token == ""
        assert {t.id for t in [*page.tasks, *rest.tasks]} == set(ids)
        failed = await client.list_tasks(
            pb.ListTasksRequest(status=pb.TaskState.TASK_STATE_FAILED, include_artifacts=True)
        )
        assert [t.id for t in failed.tasks] == [ids[2]]
        # cancel a long sleep, subscribing mid-run from another stream
        req = send_request(text_message("sleep 60"), return_immediately=True)
        async with a2a_client(agent.url, key, binding, streaming=False) as (plain, _):
            (ev,) = await collect(plain.send_message(req))
            tid = ev.task.id
            await asyncio.sleep(0.1)
            sub = client.subscribe(pb.SubscribeToTaskRequest(id=tid)).__aiter__()
            first_ev = await sub.__anext__()
            assert first_ev.task.id == tid
            assert state_name(first_ev.task) == "TASK_STATE_WORKING"
            canceled = await plain.cancel_task(pb.CancelTaskRequest(id=tid))
            assert state_name(canceled) == "TASK_STATE_CANCELED"
            rest_events = [e async for e in sub]
            assert rest_events[-1].status_update.status.state == pb.TaskState.TASK_STATE_CANCELED
            with pytest.raises(sdk_errors.TaskNotCancelableError):
                await plain.cancel_task(pb.CancelTaskRequest(id=tid))
            with pytest.raises(sdk_errors.UnsupportedOperationError):
                await collect(client.subscribe(pb.SubscribeToTaskRequest(id=tid)))
            with pytest.raises(sdk_errors.TaskNotFoundError):
                await plain.get_task(pb.GetTaskRequest(id="no-such-task"))


@pytest.mark.parametrize("binding", BINDINGS)
async def test_hitl_round_trip(agent: Agent, binding: str) -> None:
    key = await agent.key(["a2a:invoke"])
    async with a2a_client(agent.url, key, binding, streaming=False) as (client, _):
        (ev,) = await collect(client.send_message(send_request(text_message("ask"))))
        task = ev.task
        assert state_name(task) == "TASK_STATE_INPUT_REQUIRED"
        assert task.status.message.parts[0].text == "Continue? (y/n)"
        answer = text_message("y", task_id=task.id, context_id=task.context_id)
        (ev,) = await collect(client.send_message(send_request(answer)))
        assert state_name(ev.task) == "TASK_STATE_COMPLETED"
        assert "you said y" in artifact_text(ev.task)


async def test_a_prompt_before_working_is_stored_still_asks(agent: Agent) -> None:
    """`working` is stored a moment after the run starts (to batch writes); a prompt the run
    shows at once used to be dropped, and the task waited for ever."""
    key = await agent.key(["a2a:invoke"])
    async with a2a_client(agent.url, key, "JSONRPC", streaming=False) as (client, _):
        (ev,) = await collect(client.send_message(send_request(text_message("ask now"))))
        assert state_name(ev.task) == "TASK_STATE_INPUT_REQUIRED"
        answer = text_message("n", task_id=ev.task.id, context_id=ev.task.context_id)
        (ev,) = await collect(client.send_message(send_request(answer)))
        assert state_name(ev.task) == "TASK_STATE_COMPLETED"


@pytest.mark.parametrize("binding", BINDINGS)
async def test_rejections(agent: Agent, binding: str) -> None:
    key = await agent.key(["a2a:invoke"])
    async with a2a_client(agent.url, key, binding, streaming=False) as (client, _):
        (ev,) = await collect(client.send_message(send_request(data_message({"name": 5}, "greet"))))
        assert state_name(ev.task) == "TASK_STATE_REJECTED"
        assert "data.name" in ev.task.status.message.parts[0].text
    reader = await agent.key(["a2a:read"])
    async with a2a_client(agent.url, reader, binding, streaming=False) as (client, _):
        with pytest.raises(Exception) as err:
            await collect(client.send_message(send_request(text_message("echo hello"))))
        assert "403" in str(err.value) or "PERMISSION" in str(err.value).upper()


async def test_idempotent_message_id(agent: Agent) -> None:
    key = await agent.key(["a2a:invoke"])
    async with a2a_client(agent.url, key, "JSONRPC", streaming=False) as (client, _):
        msg = text_message("echo hello", message_id="fixed-1")
        (a,) = await collect(client.send_message(send_request(msg)))
        (b,) = await collect(client.send_message(send_request(msg)))
        assert a.task.id == b.task.id
        with pytest.raises(sdk_errors.InvalidParamsError):
            await collect(
                client.send_message(send_request(text_message("echo other", message_id="fixed-1")))
            )


# ---- raw HTTP: headers, errors and formats ------------------------------------------------
async def _rpc(
    agent: Agent, key: str | None, method: str, params: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    h = {**V, **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient() as http:
        return await http.post(
            agent.url,
            json={"jsonrpc": "2.0", "id": 7, "method": method, "params": params},
            headers=h,
        )


async def test_version_header_is_required(agent: Agent) -> None:
    key = await agent.key(["a2a:read"])
    for headers in ({"A2A-Version": ""}, {"A2A-Version": "0.3"}, {"A2A-Version": "2.0"}):
        resp = await _rpc(agent, key, "ListTasks", {}, headers)
        body = resp.json()
        assert resp.status_code == 200 and body["error"]["code"] == -32009
        assert body["error"]["data"][0]["reason"] == "VERSION_NOT_SUPPORTED"
        async with httpx.AsyncClient() as http:
            r = await http.get(
                agent.url + "/tasks", headers={"Authorization": f"Bearer {key}", **headers}
            )
        assert r.status_code == 400
        assert r.json()["error"]["details"][0]["reason"] == "VERSION_NOT_SUPPORTED"
    assert (await _rpc(agent, key, "ListTasks", {}, {"A2A-Version": "1.0"})).json()["result"]


async def test_credentials_and_scopes(agent: Agent) -> None:
    resp = await _rpc(agent, None, "ListTasks", {})
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert resp.json()["error"]["data"][0]["reason"] == "UNAUTHENTICATED"
    await agent.add_instance("vm9")
    other = await agent.key(["a2a:read", "a2a:invoke"], instance_id="vm9")
    resp = await _rpc(agent, other, "ListTasks", {})
    assert resp.status_code == 403
    reader = await agent.key(["a2a:read"])
    msg = {"message": {"messageId": "x1", "role": "ROLE_USER", "parts": [{"text": "echo hi"}]}}
    resp = await _rpc(agent, reader, "SendMessage", msg)
    assert resp.status_code == 403 and "a2a:invoke" in resp.json()["error"]["message"]
    viewer = await agent.token("alice", "viewer")
    assert (await _rpc(agent, viewer, "SendMessage", msg)).status_code == 403
    assert "result" in (await _rpc(agent, viewer, "ListTasks", {})).json()
    bob = await agent.token("bob")
    resp = await _rpc(agent, bob, "ListTasks", {})
    assert resp.json()["error"]["code"] == -32001  # not bob's agent: not found


async def test_unknown_instance(agent: Agent) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.get(
            agent.base + "/agents/nope/tasks",
            headers={**V, "Authorization": f"Bearer {agent.admin}"},
        )
        assert r.status_code == 404
        assert r.json()["error"]["details"][0]["reason"] == "TASK_NOT_FOUND"
        r = await http.post(
            agent.base + "/agents/nope",
            json={"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}},
            headers={**V, "Authorization": f"Bearer {agent.admin}"},
        )
        assert r.json()["error"]["code"] == -32001


async def test_jsonrpc_protocol_errors(agent: Agent) -> None:
    key = await agent.key(["a2a:read", "a2a:invoke"])
    h = {**V, "Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient() as http:
        r = await http.post(
            agent.url + "/", content=b"{nope", headers={**h, "Content-Type": "application/json"}
        )
        assert r.json()["error"]["code"] == -32700 and r.json()["id"] is None
        r = await http.post(agent.url, json=[{"jsonrpc": "2.0"}], headers=h)
        assert r.json()["error"]["code"] == -32600
        r = await http.post(
            agent.url, json={"jsonrpc": "2.0", "id": 3, "method": "Nope"}, headers=h
        )
        assert r.json()["error"]["code"] == -32601 and r.json()["id"] == 3
        r = await http.post(
            agent.url,
            json={
                "jsonrpc": "2.0",
                "id": "a",
                "method": "SendMessage",
                "params": {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{}]}},
            },
            headers={**h, "Content-Type": "application/a2a+json"},
        )
        err = r.json()["error"]
        assert err["code"] == -32602
        assert "message.parts[0]" in err["message"]
        assert err["data"][1]["fieldViolations"][0]["field"] == "message.parts[0]"
        r = await http.post(agent.url, content=b"{}", headers={**h, "Content-Type": "text/plain"})
        assert r.json()["error"]["code"] == -32600


async def test_rest_errors_and_file_parts(agent: Agent) -> None:
    key = await agent.key(["a2a:read", "a2a:invoke"])
    h = {**V, "Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient() as http:
        r = await http.post(
            agent.url + "/message:send",
            json={
                "message": {
                    "messageId": "f1",
                    "role": "ROLE_USER",
                    "parts": [{"url": "http://x/y"}],
                }
            },
            headers=h,
        )
        assert r.status_code == 415
        assert r.json()["error"]["details"][0]["reason"] == "CONTENT_TYPE_NOT_SUPPORTED"
        r = await http.get(agent.url + "/tasks?pageSize=500", headers=h)
        assert r.status_code == 400 and "pageSize" in r.json()["error"]["message"]
        r = await http.get(agent.url + "/tasks?pageToken=garbage", headers=h)
        assert r.status_code == 400
        r = await http.get(agent.url + "/tasks/x:frobnicate", headers=h)
        assert r.status_code == 404
        assert r.json()["error"]["details"][0]["reason"] == "METHOD_NOT_FOUND"


@pytest.mark.parametrize("binding", BINDINGS)
async def test_push_config_crud(agent: Agent, binding: str) -> None:
    key = await agent.key(["a2a:read", "a2a:invoke"])
    async with a2a_client(agent.url, key, binding, streaming=False) as (client, _):
        (ev,) = await collect(
            client.send_message(send_request(text_message("sleep 60"), return_immediately=True))
        )
        tid = ev.task.id
        cfg = pb.TaskPushNotificationConfig(
            task_id=tid, url="http://127.0.0.1:9/hook", token="tok-1", id="c1"
        )
        made = await client.create_task_push_notification_config(cfg)
        assert made.id == "c1" and made.token == "tok-1"
        got = await client.get_task_push_notification_config(
            pb.GetTaskPushNotificationConfigRequest(task_id=tid, id="c1")
        )
        assert got.url == "http://127.0.0.1:9/hook"
        listed = await client.list_task_push_notification_configs(
            pb.ListTaskPushNotificationConfigsRequest(task_id=tid)
        )
        assert [c.id for c in listed.configs] == ["c1"]
        await client.delete_task_push_notification_config(
            pb.DeleteTaskPushNotificationConfigRequest(task_id=tid, id="c1")
        )
        with pytest.raises(sdk_errors.TaskNotFoundError):
            await client.get_task_push_notification_config(
                pb.GetTaskPushNotificationConfigRequest(task_id=tid, id="c1")
            )
        ext = await client.get_extended_agent_card(pb.GetExtendedAgentCardRequest())
        assert any(e.uri.endswith("/instance/v1") for e in ext.capabilities.extensions)
        await client.cancel_task(pb.CancelTaskRequest(id=tid))
