"""Reliability: kill -9 of the server during an output flood, lossless reattach; stalled and
slow observers never slow the PTY or the controller."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import pytest

from tests.support.fixtures import AgentFactory, ServerFactory
from tests.support.ptyclient import PtyClient
from tests.support.sessions import (
    SHELL,
    RawWebSocket,
    create_session,
    metric,
    stalled_client,
    wait_state,
)

pytestmark = pytest.mark.timeout(300)

LINES = 2_000_000  # `seq` output: 14.9 MB


async def test_kill9_server_during_flood_then_reattach_is_lossless(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    # This test is about losslessness across a crash, not about backpressure: a larger ring
    # and lag bound keep a busy test machine from turning a slow reader into a resync.
    server = server_factory(
        SANDBOX_SESSION_RING_BYTES=str(32 * 1024 * 1024),
        SANDBOX_SESSION_CLIENT_MAX_LAG_BYTES=str(24 * 1024 * 1024),
    )
    agent = agent_factory(server)
    out = tmp_path / "pty-output.txt"
    # The PTY's output, byte for byte, is also written to a file through `tee`; `stty -opost`
    # keeps the terminal from turning \n into \r\n so the two are comparable.
    cmd = [
        "sh",
        "-c",
        f"stty -opost -echo; sleep 0.5; seq 1 {LINES} | tee {out}; echo FLOOD-DONE; sleep 600",
    ]
    sid = create_session(server, agent.instance_id, cmd)
    tok = server.admin_token
    first = await PtyClient.connect(server.ws_url, sid, tok, from_offset=0)
    second = await PtyClient.connect(server.ws_url, sid, tok, from_offset=0)
    await first.wait_offset(2_500_000, timeout=60)
    server.kill9()  # mid-flood, with both observers attached
    await asyncio.wait_for(first.closed.wait(), 10)
    await asyncio.wait_for(second.closed.wait(), 10)
    assert not first.resyncs and not second.resyncs
    assert first.next is not None and first.next < LINES * 7, "the flood was already over"
    got = {"first": (bytes(first.data), first.next), "second": (bytes(second.data), second.next)}
    await first.close()
    await second.close()

    server.start()
    # Both observers come back with their last offsets (as a browser would, right away); the
    # agent reconnects on its own (jittered backoff) and resends from the server's ring start.
    again = {
        name: await PtyClient.connect(server.ws_url, sid, tok, from_offset=offset)
        for name, (_, offset) in got.items()
    }
    try:
        for name, client in again.items():
            assert client.hello["from"] == got[name][1], client.hello
        for client in again.values():
            await client.wait_output(b"FLOOD-DONE", timeout=120)
        expected = out.read_bytes()
        assert len(expected) == sum(len(f"{i}\n") for i in range(1, LINES + 1))
        digest = hashlib.sha256(expected).hexdigest()
        for name, client in again.items():
            assert not client.resyncs, f"{name} was resynced: {client.resyncs[:1]}"
            stream = got[name][0] + bytes(client.data)
            assert hashlib.sha256(stream[: len(expected)]).hexdigest() == digest, (
                f"{name}: what the observer got differs from what the PTY wrote"
            )
            assert stream[len(expected) :].startswith(b"FLOOD-DONE"), f"{name}: tail differs"
    finally:
        for client in again.values():
            await client.close()
    info = server.ok("GET", f"/api/v2/admin/sessions/{sid}")
    assert info["state"] == "running" and info["agent_connected"]
    server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")


async def test_sessions_survive_server_restart_and_exit_while_down(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    server = server_factory()
    agent = agent_factory(server)
    marker = tmp_path / "exited"  # the host agent's command writes it on its way out
    sid = create_session(
        server, agent.instance_id, ["sh", "-c", f"sleep 2; echo finished; : > {marker}; exit 5"]
    )
    server.kill9()
    deadline = time.monotonic() + 30
    while not marker.exists():  # the command exits while the server is down
        assert time.monotonic() < deadline, "the command did not exit"
        await asyncio.sleep(0.05)
    server.start()
    info = wait_state(server, sid, ("exited",), timeout=30)
    assert info["exit_code"] == 5
    async with await PtyClient.connect(server.ws_url, sid, server.admin_token, from_offset=0) as c:
        await c.wait_output(b"finished")
        await c.wait_control("exit")


async def test_stalled_observer_is_dropped_and_the_controller_keeps_flowing(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory(SANDBOX_SESSION_CLIENT_STALL_SECONDS="2")
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    tok = server.admin_token
    async with await PtyClient.connect(server.ws_url, sid, tok, role="control") as ctl:
        ctl.keep_data = True
        # A background flood (about 6 MB/s) fills the stalled client's socket quickly.
        await ctl.send_input(
            b"( while :; do head -c 65536 /dev/zero | tr '\\0' x; sleep 0.01; done ) & \r"
        )
        _reader, writer = await stalled_client(server, sid, tok)
        try:
            latencies = []
            deadline = time.monotonic() + 8
            i = 0
            while time.monotonic() < deadline:
                i += 1
                marker = f"MARK{i}Z".encode()
                started = time.monotonic()
                ctl.data.clear()
                await ctl.send_input(b"echo " + marker + b"\r")
                await ctl.wait_output(marker, timeout=10)
                latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.2)
            members = server.ok("GET", f"/api/v2/admin/sessions/{sid}")["members"]
            assert len(members) == 1, f"the stalled observer is still attached: {members}"
            assert metric(server, "sandbox_session_client_drops_total") >= 1
            # each echo came back (wait_output's deadline) while the observer stalled; how
            # fast is bench_sessions.py's `stalled` measure, not a limit here
            assert len(latencies) >= 3, latencies
        finally:
            writer.close()
        await ctl.send_input(b"kill %1\r")


async def test_slow_observer_is_resynced_to_a_snapshot(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory(SANDBOX_SESSION_CLIENT_MAX_LAG_BYTES="131072")
    agent = agent_factory(server)
    cmd = ["sh", "-c", "while :; do head -c 1048576 /dev/zero | tr '\\0' y; sleep 0.05; done"]
    sid = create_session(server, agent.instance_id, cmd)
    ws = await RawWebSocket.connect(server, sid, server.admin_token, "role=observe&from=0")
    try:
        await asyncio.sleep(1.5)  # do not read for a while (less than the stall limit)
        resync = None
        deadline = time.monotonic() + 30
        while resync is None and time.monotonic() < deadline:
            opcode, payload = await ws.frame()
            if opcode == 1:
                ctl = json.loads(payload)
                if ctl["type"] == "resync" and ctl["reason"] == "behind":
                    resync = ctl
        assert resync is not None, "a client that fell behind was not resynced"
        assert "screen" in resync and resync["offset"] > 0
        # After the resync, frames continue exactly at the resync offset.
        while True:
            opcode, payload = await ws.frame()
            if opcode == 2:
                assert int.from_bytes(payload[:8], "big") == resync["offset"]
                break
    finally:
        ws.close()
    assert metric(server, "sandbox_session_resyncs_total") >= 1
    server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
