"""A real host agent given both control hosts: a follower names the leader and the agent dials
it; when the leader is killed (-9) mid-flood the agent follows the failover on its own, and an
observer that reattaches to the new leader with its offset gets every byte the PTY wrote; a
task running through the failover completes once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from agentic_sandbox.proto import LEADER_METADATA
from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc
from tests.postgres.test_cluster_servers import TIMEOUT, node, roles
from tests.support.agents import AgentProcess, enrollment_token, register_host_instance
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import create_session

pytestmark = pytest.mark.timeout(300)

LINES = 1_500_000  # `seq` output: 10.9 MB
BIG = {
    # losslessness across a failover, not backpressure: room for a busy machine's slow reader
    "SANDBOX_SESSION_RING_BYTES": str(32 * 1024 * 1024),
    "SANDBOX_SESSION_CLIENT_MAX_LAG_BYTES": str(24 * 1024 * 1024),
}


def both(first: ServerProcess, second: ServerProcess) -> list[str]:
    """The agent's control addresses, `first` listed first."""
    return [
        "--server",
        f"{first.grpc_target},{second.grpc_target}",
        "--enroll-server",
        f"{first.enroll_target},{second.enroll_target}",
    ]


async def test_a_follower_refuses_agents_naming_the_leader(pg_url: str, tmp_path: Path) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    try:
        n1.start(TIMEOUT)
        n2.start(TIMEOUT)
        leader, _ = roles(n1, n2)
        follower = n2 if leader is n1 else n1
        lname = "n1" if leader is n1 else "n2"
        # an rpc on the follower's enrollment listener (server TLS, no client certificate)
        creds = grpc.ssl_channel_credentials(root_certificates=follower.ca_path.read_bytes())
        async with grpc.aio.secure_channel(
            follower.enroll_target,
            creds,
            options=[("grpc.ssl_target_name_override", "agentic-sandbox-server")],
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.AgentLinkStub(channel).Enroll(
                    pb.EnrollRequest(instance_id="x", token="sbe_x", csr_pem=b""), timeout=10
                )
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert dict(err.value.trailing_metadata() or ())[LEADER_METADATA] == (
            f"{lname} {leader.grpc_target}"
        )
        assert "follower" in (err.value.details() or "")

        # an agent whose first address is the follower's enrolls and links with the leader
        register_host_instance(leader, "agent-a")
        agent = AgentProcess(
            leader,
            "agent-a",
            tmp_path / "agent-a",
            enrollment_token=enrollment_token(leader, "agent-a"),
            extra_args=both(follower, leader),
        ).start()
        try:
            agent.wait_connected(TIMEOUT)
            log = agent.log_text()
            assert f"control host {lname} leads: dialling {leader.grpc_target}" in log
            assert f"connected to {leader.grpc_target}" in log
        finally:
            agent.stop()
    finally:
        n1.stop()
        n2.stop()


async def test_an_agent_follows_a_kill9_failover_and_no_output_is_lost(
    pg_url: str, tmp_path: Path
) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    n1.extra_env.update(BIG)
    n2.extra_env.update(BIG)
    agent: AgentProcess | None = None
    clients: list[PtyClient] = []
    try:
        n1.start(TIMEOUT)
        n2.start(TIMEOUT)
        leader, docs = roles(n1, n2)
        follower = n2 if leader is n1 else n1
        term = docs[(n1, n2).index(leader)]["term"]
        register_host_instance(leader, "agent-b")
        agent = AgentProcess(
            leader,
            "agent-b",
            tmp_path / "agent-b",
            enrollment_token=enrollment_token(leader, "agent-b"),
            extra_args=both(leader, follower),
        ).start()
        agent.wait_connected(TIMEOUT)

        out = tmp_path / "pty-output.txt"  # the PTY's output, byte for byte, through `tee`
        cmd = [
            "sh",
            "-c",
            f"stty -opost -echo; sleep 0.5; seq 1 {LINES} | tee {out}; echo FLOOD-DONE; "
            "read line; echo got:$line; sleep 600",
        ]
        sid = create_session(leader, "agent-b", cmd)
        first = await PtyClient.connect(leader.ws_url, sid, leader.admin_token, from_offset=0)
        clients.append(first)
        await first.wait_offset(1_500_000, timeout=60)
        leader.kill9()  # mid-flood, with the observer attached
        died = time.time()
        await asyncio.wait_for(first.closed.wait(), 10)
        assert first.next is not None and first.next < LINES * 7, "the flood was already over"
        seen, offset = bytes(first.data), first.next

        new_leader, docs = roles(follower)
        assert new_leader is follower and docs[0]["term"] == term + 1
        agent.server = follower
        agent.wait_connected(TIMEOUT, since=died)  # on its own: nobody restarted it

        # the observer reattaches to the new leader with its offset (as the dashboard does)
        again = await PtyClient.connect(
            follower.ws_url, sid, follower.admin_token, from_offset=offset
        )
        clients.append(again)
        assert again.hello["from"] == offset, again.hello
        await again.wait_output(b"FLOOD-DONE", timeout=120)
        expected = out.read_bytes()
        assert len(expected) == sum(len(f"{i}\n") for i in range(1, LINES + 1))
        stream = seen + bytes(again.data)
        assert not again.resyncs, f"resynced: {again.resyncs[:1]}"
        assert hashlib.sha256(stream[: len(expected)]).hexdigest() == (
            hashlib.sha256(expected).hexdigest()
        ), "what the observer got differs from what the PTY wrote"

        # the session is writable through the new leader
        ctl = await PtyClient.connect(follower.ws_url, sid, follower.admin_token, role="control")
        clients.append(ctl)
        await ctl.send_input(b"hello\n")
        await again.wait_output(b"got:hello", timeout=30)
        info = follower.ok("GET", f"/api/v2/admin/sessions/{sid}")
        assert info["state"] == "running" and info["agent_connected"]
        log = agent.log_text()
        assert f"connected to {follower.grpc_target}" in log
    finally:
        for c in clients:
            await c.close()
        if agent is not None:
            agent.stop()
        n1.stop()
        n2.stop()


def a2a(srv: ServerProcess, method: str, path: str, key: str, body: Any = None) -> Any:
    r = httpx.request(
        method,
        f"{srv.url}/agents/agent-t{path}",
        json=body,
        headers={"Authorization": f"Bearer {key}", "A2A-Version": "1.0"},
        timeout=30,
    )
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def task_agent(
    leader: ServerProcess, tmp_path: Path, addresses: list[str]
) -> tuple[AgentProcess, str]:
    """Host instance `agent-t` with a task runner, its agent linked, and an A2A key for it."""
    home = tmp_path / "home"  # the login shell must not read the machine user's profile
    home.mkdir()
    runner = {"argv": ["bash", "-lc", "{text}"], "env": {"HOME": str(home)}}
    register_host_instance(leader, "agent-t", task_runner=runner)
    key = leader.ok(
        "POST",
        "/api/v2/admin/api-keys",
        {"instance_id": "agent-t", "scopes": ["a2a:read", "a2a:invoke"]},
    )["key"]
    agent = AgentProcess(
        leader,
        "agent-t",
        tmp_path / "agent-t",
        enrollment_token=enrollment_token(leader, "agent-t"),
        extra_args=addresses,
    ).start()
    try:
        agent.wait_connected(TIMEOUT)
    except BaseException:
        agent.stop()
        raise
    return agent, str(key)


async def test_a_task_running_across_a_kill9_failover_completes_once(
    pg_url: str, tmp_path: Path
) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    agent: AgentProcess | None = None
    try:
        n1.start(TIMEOUT)
        n2.start(TIMEOUT)
        leader, _ = roles(n1, n2)
        follower = n2 if leader is n1 else n1
        agent, key = task_agent(leader, tmp_path, both(leader, follower))

        runs = tmp_path / "runs"  # one line per time the task's command ran
        send = {
            "message": {
                "messageId": "failover-1",
                "role": "ROLE_USER",
                "parts": [{"text": f"echo run >> {runs}; echo started; sleep 4; echo finished"}],
            },
            "configuration": {"returnImmediately": True},
        }
        task_id = a2a(leader, "POST", "/message:send", key, send)["task"]["id"]
        deadline = time.monotonic() + TIMEOUT
        while not runs.exists():  # the run has started on the agent
            assert time.monotonic() < deadline, "the task did not start"
            await asyncio.sleep(0.05)
        leader.kill9()
        new_leader, _ = roles(follower)
        assert new_leader is follower

        deadline = time.monotonic() + TIMEOUT
        while True:
            task = a2a(follower, "GET", f"/tasks/{task_id}", key)
            state = task["status"]["state"]
            if state not in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"):
                break
            assert time.monotonic() < deadline, f"the task is still {state}"
            await asyncio.sleep(0.2)
        assert state == "TASK_STATE_COMPLETED", task["status"]
        text = "".join(p.get("text", "") for a in task.get("artifacts", []) for p in a["parts"])
        assert "started" in text and "finished" in text, text
        assert runs.read_text() == "run\n", "the task's command ran more than once"
        # the same message again is the same task, not a second run
        again = a2a(follower, "POST", "/message:send", key, send)["task"]
        assert again["id"] == task_id
        await asyncio.sleep(1)
        assert runs.read_text() == "run\n"
    finally:
        if agent is not None:
            agent.stop()
        n1.stop()
        n2.stop()


async def test_restarting_both_nodes_one_at_a_time_loses_no_session_and_no_task(
    pg_url: str, tmp_path: Path
) -> None:
    """A control-plane upgrade: each node stopped (SIGTERM) and started again in turn, with a
    session printing and a task running throughout."""
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    agent: AgentProcess | None = None
    try:
        n1.start(TIMEOUT)
        n2.start(TIMEOUT)
        leader, _ = roles(n1, n2)
        agent, key = task_agent(leader, tmp_path, both(n1, n2))
        sid = create_session(
            leader,
            "agent-t",
            [
                "sh",
                "-c",
                "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo tick-$i; sleep 0.05; done; "
                "echo TICKS-DONE; sleep 600",
            ],
        )
        runs = tmp_path / "runs"
        send = {
            "message": {
                "messageId": "rolling-1",
                "role": "ROLE_USER",
                "parts": [{"text": f"echo run >> {runs}; sleep 8; echo finished"}],
            },
            "configuration": {"returnImmediately": True},
        }
        task_id = a2a(leader, "POST", "/message:send", key, send)["task"]["id"]
        for _ in range(2):  # each node in turn: stop the leader, bring it back as a follower
            leader, _ = roles(n1, n2)
            other = n2 if leader is n1 else n1
            stopped = time.time()
            assert leader.stop(TIMEOUT) == 0
            new, _ = roles(other)
            assert new is other
            agent.server = other
            agent.wait_connected(TIMEOUT, since=stopped)
            leader.start(TIMEOUT)
            roles(n1, n2)
        leader, _ = roles(n1, n2)
        deadline = time.monotonic() + TIMEOUT
        while True:
            task = a2a(leader, "GET", f"/tasks/{task_id}", key)
            if task["status"]["state"] not in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"):
                break
            assert time.monotonic() < deadline, task["status"]
            await asyncio.sleep(0.2)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", json.dumps(
            task["status"]["message"]["parts"]
        )
        assert runs.read_text() == "run\n"
        async with await PtyClient.connect(
            leader.ws_url, sid, leader.admin_token, from_offset=0
        ) as watcher:
            await watcher.wait_output(b"TICKS-DONE", timeout=60)
            lines = [ln for ln in bytes(watcher.data).decode().split() if ln.startswith("tick-")]
        assert lines == [f"tick-{i}" for i in range(1, 301)]  # every line, once, in order
    finally:
        if agent is not None:
            agent.stop()
        n1.stop()
        n2.stop()
