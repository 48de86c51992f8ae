"""Push-notification destinations: loopback, private, link-local, metadata and other non-public
addresses are refused when a config is set and again when a notification is sent, unless the
operator's `push_allow_networks` names them; failures are recorded in fixed words.

Nothing here connects anywhere but 127.0.0.1: non-loopback ranges are checked with the policy
alone, or set on a task that has ended (a config there is stored but never sent, so even a
missing check could not make the server connect); names resolve through a fake resolver that
answers with loopback addresses (no DNS query leaves the process).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from agentic_sandbox.broker.observability.events import EventFilter
from agentic_sandbox.broker.tasks.destinations import DestinationPolicy, is_public
from tests.support.inproc_server import free_port
from tests.unit.a2a.conftest import Agent

V = {"A2A-Version": "1.0"}
NOT_ALLOWED = "destination not allowed"
NO_LOOPBACK = [{"push_allow_networks": []}]

REFUSED = [
    "127.0.0.1",
    "127.9.9.9",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.0.1",
    "169.254.169.254",  # cloud metadata (link-local)
    "100.100.100.200",  # metadata on another cloud (shared address space)
    "0.0.0.0",
    "255.255.255.255",
    "224.0.0.251",
    "192.0.2.7",
    "::1",
    "::",
    "fe80::1",
    "fe80::1%1",
    "fd00:ec2::254",  # metadata over IPv6 (ULA)
    "fc00::1",
    "ff02::1",
    "::ffff:127.0.0.1",
    "::ffff:169.254.169.254",
    "2002:a9fe:a9fe::1",  # 6to4 around 169.254.169.254
    "64:ff9b::a9fe:a9fe",  # NAT64 around it
]
PUBLIC = ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert not is_public(ip)
    assert not DestinationPolicy().permits(ip)


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_permitted(address: str) -> None:
    assert DestinationPolicy().permits(ipaddress.ip_address(address))


def test_the_allow_list_names_exactly_what_it_allows() -> None:
    policy = DestinationPolicy(["127.0.0.1", "10.0.0.0/8", "fd00:ec2::/32"])
    allowed = ["127.0.0.1", "10.200.1.1", "fd00:ec2::254", "8.8.8.8"]
    refused = ["127.0.0.2", "::1", "169.254.169.254", "192.168.1.1", "::ffff:10.1.1.1"]
    assert [policy.permits(ipaddress.ip_address(a)) for a in allowed] == [True] * 4
    assert [policy.permits(ipaddress.ip_address(a)) for a in refused] == [False] * 5


def test_a_bad_allow_list_entry_fails_start_up() -> None:
    from agentic_sandbox.broker.config import Settings

    with pytest.raises(ValueError, match="not an IP network"):
        Settings(data_dir="/tmp/x", push_allow_networks=["localhost"])


# ---- on the in-process server ------------------------------------------------------------
class Receiver:
    def __init__(self) -> None:
        self.got: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.got.append(dict(request.headers))
        await request.read()
        return web.Response(status=204)


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[int, Receiver]]:
    rec = Receiver()
    app = web.Application()
    app.router.add_route("*", "/hook", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port, rec
    finally:
        await runner.cleanup()


class FakeDNS(AbstractResolver):
    """Answers every name with the next of `answers` (the last one once they run out)."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.calls.append(host)
        addresses = self.answers[min(len(self.calls), len(self.answers)) - 1]
        return [
            ResolveResult(
                hostname=host,
                host=a,
                port=port,
                family=socket.AF_INET6 if ":" in a else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for a in addresses
        ]

    async def close(self) -> None:
        pass


async def _call(agent: Agent, key: str, method: str, path: str, body: Any = None) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.request(
            method,
            agent.url + path,
            json=body,
            headers={**V, "Authorization": f"Bearer {key}"},
        )


async def _task(agent: Agent, key: str, text: str, push: dict[str, Any] | None = None) -> Any:
    config: dict[str, Any] = {"returnImmediately": True}
    if push is not None:
        config["taskPushNotificationConfig"] = push
    message = {"messageId": f"m-{time.time_ns()}", "role": "ROLE_USER", "parts": [{"text": text}]}
    return await _call(
        agent, key, "POST", "/message:send", {"message": message, "configuration": config}
    )


async def _ended_task(agent: Agent, key: str) -> str:
    r = await _task(agent, key, "exit 7")
    tid = str(r.json()["task"]["id"])
    for _ in range(500):
        got = await _call(agent, key, "GET", f"/tasks/{tid}")
        if got.json()["status"]["state"] == "TASK_STATE_FAILED":
            return tid
        await asyncio.sleep(0.01)
    raise AssertionError("the task did not end")


def _refused_url(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["details"][1]["fieldViolations"][0]["field"] == "url"
    return str(error["message"])


@pytest.mark.parametrize("agent", NO_LOOPBACK, indirect=True)
async def test_loopback_is_refused_when_set_and_nothing_is_stored(
    agent: Agent, receiver: tuple[int, Receiver]
) -> None:
    port, rec = receiver
    key = await agent.key(["a2a:read", "a2a:invoke"])
    agent.tasks.push.destinations.inner = FakeDNS(["127.0.0.1"])
    urls = [
        f"http://127.0.0.1:{port}/hook",
        f"http://[::ffff:127.0.0.1]:{port}/hook",
        f"http://0.0.0.0:{port}/hook",
        f"http://hooks.example.test:{port}/hook",  # a name that resolves to loopback
    ]
    # with the message
    for url in urls:
        message = _refused_url(await _task(agent, key, "sleep 60", {"url": url}))
        assert "127.0.0.1" not in message and str(port) not in message
    # on a running task
    r = await _task(agent, key, "sleep 60")
    tid = r.json()["task"]["id"]
    for url in urls:
        _refused_url(
            await _call(agent, key, "POST", f"/tasks/{tid}/pushNotificationConfigs", {"url": url})
        )
    listed = await _call(agent, key, "GET", f"/tasks/{tid}/pushNotificationConfigs")
    assert listed.json().get("configs", []) == []
    assert not agent.tasks.push.has_targets(tid)
    assert rec.got == []


@pytest.mark.parametrize("agent", NO_LOOPBACK, indirect=True)
async def test_private_link_local_and_metadata_are_refused_when_set(agent: Agent) -> None:
    key = await agent.key(["a2a:read", "a2a:invoke"])
    tid = await _ended_task(agent, key)  # (a config here is never sent, refused or not)
    agent.tasks.push.destinations.inner = FakeDNS(["169.254.169.254"])
    urls = [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/hook",
        "https://192.168.1.1/hook",
        "http://100.100.100.200/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://[fe80::1]/hook",
        "http://[::ffff:169.254.169.254]/hook",
        "http://metadata.example.test/computeMetadata/v1/",  # a name for the metadata address
    ]
    for url in urls:
        message = _refused_url(
            await _call(agent, key, "POST", f"/tasks/{tid}/pushNotificationConfigs", {"url": url})
        )
        assert "169.254" not in message and "10.0" not in message
    # a public address is accepted (and, the task having ended, never sent to)
    r = await _call(
        agent,
        key,
        "POST",
        f"/tasks/{tid}/pushNotificationConfigs",
        {"url": "https://93.184.216.34/h"},
    )
    assert r.status_code == 200, r.text
    listed = await _call(agent, key, "GET", f"/tasks/{tid}/pushNotificationConfigs")
    assert [c["url"] for c in listed.json()["configs"]] == ["https://93.184.216.34/h"]


async def test_a_name_is_checked_again_when_sent_and_rebinding_is_refused(
    agent: Agent, receiver: tuple[int, Receiver]
) -> None:
    port, rec = receiver
    key = await agent.key(["a2a:read", "a2a:invoke"])
    # allowed when set (127.0.0.1 is on this server's allow-list); by the time of sending the
    # name also resolves to ::1, which is not: the whole name is refused, nothing is sent
    dns = FakeDNS(["127.0.0.1"], ["127.0.0.1", "::1"])
    agent.tasks.push.destinations.inner = dns
    url = f"http://hooks.example.test:{port}/hook"
    r = await _task(agent, key, "echo hello", {"url": url, "token": "t"})
    assert r.status_code == 200, r.text
    tid = r.json()["task"]["id"]
    for _ in range(500):  # the webhook's worker ends after the task's last event
        if not agent.tasks.push.has_targets(tid):
            break
        await asyncio.sleep(0.01)
    assert not agent.tasks.push.has_targets(tid)
    assert rec.got == []
    found = await agent.svc.events.query(
        0, 50, EventFilter(task_id=tid, types=("task.push_failed",))
    )
    assert found and all(e.data["error"] == NOT_ALLOWED for e in found)
    assert all(e.data["attempts"] == 1 for e in found)  # a refusal is not retried
    assert len(dns.calls) >= 2  # once when set, again when sent


async def test_a_name_is_sent_to_the_address_that_was_checked(
    agent: Agent, receiver: tuple[int, Receiver]
) -> None:
    port, rec = receiver
    key = await agent.key(["a2a:read", "a2a:invoke"])
    dns = FakeDNS(["127.0.0.1"])  # (the name exists nowhere else)
    agent.tasks.push.destinations.inner = dns
    r = await _task(agent, key, "echo hello", {"url": f"http://hooks.example.test:{port}/hook"})
    tid = r.json()["task"]["id"]
    for _ in range(500):
        if not agent.tasks.push.has_targets(tid):
            break
        await asyncio.sleep(0.01)
    assert rec.got and all(h["Host"] == f"hooks.example.test:{port}" for h in rec.got)
    assert set(dns.calls) == {"hooks.example.test"}


@pytest.mark.parametrize("binding", ["rest", "jsonrpc"])
async def test_a_config_on_an_ended_task_is_stored_and_never_sent(
    agent: Agent, receiver: tuple[int, Receiver], binding: str
) -> None:
    port, rec = receiver
    key = await agent.key(["a2a:read", "a2a:invoke"])
    tid = await _ended_task(agent, key)
    config = {"taskId": tid, "id": "late", "url": f"http://127.0.0.1:{port}/hook"}
    if binding == "rest":
        r = await _call(agent, key, "POST", f"/tasks/{tid}/pushNotificationConfigs", config)
        made = r.json()
    else:
        r = await _call(
            agent,
            key,
            "POST",
            "",
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "CreateTaskPushNotificationConfig",
                "params": config,
            },
        )
        made = r.json()["result"]
    assert r.status_code == 200, r.text
    assert made["id"] == "late" and made["url"] == config["url"]
    got = await _call(agent, key, "GET", f"/tasks/{tid}/pushNotificationConfigs/late")
    assert got.status_code == 200 and got.json()["url"] == config["url"]
    assert not agent.tasks.push.has_targets(tid)  # no webhook worker: nothing will be sent
    assert rec.got == []
