"""An instance id is a reusable name; an incarnation is one create of it. Deleting an instance
ends its incarnation at once, and a new instance with the same id — whoever creates it — starts
from nothing: no agent, no session, no secret, no key of the old one (boundary.md).

Real server processes, real agent-client processes with real PTYs over mTLS."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agentic_sandbox.images import ImageStore
from agentic_sandbox.provision import read_seed_iso
from tests.support.agents import AgentProcess, enrollment_token, register_host_instance
from tests.support.fake_images import publish_fake
from tests.support.fixtures import ServerFactory
from tests.support.libvirt_testdriver import node_uri
from tests.support.ptyclient import PtyClient
from tests.support.sessions import SHELL, create_session, events

SECRET = "s3cr3t-value-of-alice-7d41"


def _agent(server: Any, iid: str, token: str, where: Path) -> AgentProcess:
    return AgentProcess(server, iid, where, enrollment_token=token).start()


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _refusals_since(agent: AgentProcess, since: float) -> list[str]:
    """The server's refusals of the agent's link since `since`, as the agent logged them (the
    server aggregates repeated refusals into one audit row and event per window)."""
    out = []
    for line in agent.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        msg = str(entry.get("msg", ""))
        if "PERMISSION_DENIED" in msg and _ts(entry["time"]) >= since:
            out.append(msg)
    return out


def _card_status(server: Any, path: str, key: str) -> int:
    """GET an A2A route with an A2A key (the binding wants its version header)."""
    req = urllib.request.Request(
        server.url + path, headers={"Authorization": f"Bearer {key}", "A2A-Version": "1.0"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _ts(value: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(value).timestamp()


async def test_a_deleted_instance_leaves_nothing_to_the_next_owner_of_its_id(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory()
    alice = server.make_token("alice", "operator")
    bob = server.make_token("bob", "operator")
    iid = "reused-1"

    # alice's instance: a connected agent, a bound secret, an A2A key, an attached controller
    register_host_instance(server, iid, token=alice)
    old_agent = _agent(server, iid, enrollment_token(server, iid, token=alice), tmp_path / "a")
    old_agent.wait_connected()
    server.ok(
        "PUT", "/api/v2/admin/secrets/API_TOKEN", {"value": SECRET, "instances": [iid]}, token=alice
    )
    key = server.ok(
        "POST",
        "/api/v2/admin/api-keys",
        {"instance_id": iid, "scopes": ["a2a:read", "a2a:invoke"]},
        token=alice,
    )["key"]
    card_path = f"/agents/{iid}/extendedAgentCard"
    status = _card_status(server, card_path, key)
    assert status == 200, "the key reads alice's extended card while her instance lives"
    sid = create_session(server, iid, SHELL, token=alice)

    async with await PtyClient.connect(server.ws_url, sid, alice, role="control") as client:
        await client.send_input(b'printf "len=%s\\n" "${#API_TOKEN}"\r')
        await client.wait_output(f"len={len(SECRET)}".encode())  # the secret reached her shell
        deleted_at = time.time()
        server.ok("DELETE", f"/api/v2/admin/instances/{iid}", token=alice)
        # the attached client is told and its socket closed; its input goes nowhere
        await asyncio.wait_for(client.closed.wait(), 15)
        assert any(e.get("code") == "instance-deleted" for e in client.errors()), client.controls
        assert any(c.get("type") == "exit" and c.get("lost") for c in client.controls)

    # the live link was closed at once and every reconnect of the old agent is refused
    _wait(
        lambda: [
            e
            for e in events(server, "agent.disconnected", instance_id=iid)
            if _ts(e["time"]) >= deleted_at
        ],
        10,
        "the old link to close",
    )
    _wait(lambda: _refusals_since(old_agent, deleted_at), 15, "the old agent to be refused")
    status = _card_status(server, card_path, key)
    assert status == 401, "the deleted instance's key is dead"

    # bob creates an instance with the same id
    recreated_at = time.time()
    register_host_instance(server, iid, token=bob)
    # the old agent keeps retrying with alice's certificate: refused, never bob's agent
    refused = _wait(
        lambda: _refusals_since(old_agent, recreated_at), 15, "a refusal after the re-create"
    )
    assert "revoked" in refused[-1] or "incarnation ended" in refused[-1], refused[-1]
    agent_state = server.ok("GET", f"/api/v2/admin/agents/{iid}", token=bob)["state"]
    assert agent_state == "absent", agent_state
    status = _card_status(server, card_path, key)
    assert status == 401, "alice's old key does not read bob's card"
    status, _ = server.api("GET", f"/api/v2/admin/sessions/{sid}", token=bob)
    assert status == 404, "alice's session is not bob's"
    listed = server.ok("GET", f"/api/v2/admin/sessions?instance_id={iid}", token=bob)["items"]
    assert listed == []
    secrets = server.ok("GET", "/api/v2/admin/secrets", token=alice)["items"]
    assert [s["instances"] for s in secrets if s["name"] == "API_TOKEN"] == [[]]

    # bob's own agent: its sessions get no secret of alice's
    old_agent.stop()
    new_agent = _agent(server, iid, enrollment_token(server, iid, token=bob), tmp_path / "b")
    new_agent.wait_connected()
    env_sid = create_session(server, iid, ["env"], token=bob)
    async with await PtyClient.connect(server.ws_url, env_sid, bob, from_offset=0) as client:
        await asyncio.wait_for(client.closed.wait(), 15)
        output = bytes(client.data)
    assert b"PATH=" in output, output
    assert b"API_TOKEN" not in output and SECRET.encode() not in output
    new_agent.stop()


async def test_a_provision_interrupted_by_a_kill_leaves_no_record_and_no_usable_token(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """kill -9 while a create waits for its agent: after the restart the instance row is gone,
    the operation is failed, and the token written into its seed no longer enrolls."""
    data = tmp_path / "server-1"
    publish_fake(ImageStore(data / "images"), "fake-0123456789ab", recipe_name="fake")
    server = server_factory(
        SANDBOX_LIBVIRT_URI=node_uri(tmp_path, "local"),
        SANDBOX_KVM_PROBE="false",
        SANDBOX_PROVISION_READY_TIMEOUT_SECONDS="600",
    )
    assert server.data_dir == data
    op = server.ok(
        "POST",
        "/api/v2/admin/instances",
        {"id": "cut-1", "image": "fake-0123456789ab", "network": "isolated"},
    )

    def enrolling() -> bool:
        got = server.ok("GET", f"/api/v2/admin/operations/{op['id']}")
        return bool(got["stage"] == "enrolling")

    _wait(enrolling, 30, "the provision to wait at enrolling")
    seeds = [p for p in data.rglob("*.iso") if "cut-1" in p.name]
    assert seeds, sorted(str(p) for p in data.rglob("*"))
    identity = read_seed_iso(seeds[0])["agentic-sandbox.json"]
    token = json.loads(identity)["enrollment_token"]
    assert token.startswith("sbe_")

    server.kill9()
    server.start()
    got = server.ok("GET", f"/api/v2/admin/operations/{op['id']}")
    assert got["state"] == "failed", got
    status, _ = server.api("GET", "/api/v2/admin/instances/cut-1")
    assert status == 404, "no instance record survives an interrupted provision"
    assert not list((data / "provision" / "seeds").glob("*.iso*")), "its seed is removed"
    # the token in the (gone) seed does not enroll: an agent that has it is refused
    agent = AgentProcess(server, "cut-1", tmp_path / "thief", enrollment_token=token).start()
    try:
        _wait(lambda: "refused" in agent.log_text(), 20, "the enrollment to be refused")
    finally:
        agent.stop()
    assert not (tmp_path / "thief" / "agent.crt").exists()
