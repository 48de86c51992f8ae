"""Sessions outlive the agent worker (`agent/keeper.py`): a `kill -9` of the worker during an
output flood loses no byte and the same process stays writable; a planned restart (SIGHUP to
the agent) keeps the sessions too; a session that exits under a new worker reports its code."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory, ServerFactory
from tests.support.ptyclient import PtyClient
from tests.support.sessions import create_session, first_difference, wait_state

pytestmark = pytest.mark.timeout(300)

LINES = 1_500_000  # `seq` output: 10.9 MB


def worker_of(agent: AgentProcess) -> int:
    return agent.worker_pid()


FLOOD_SERVER = {
    # losslessness across a worker restart, not backpressure: room for a slow reader
    "SANDBOX_SESSION_RING_BYTES": str(32 * 1024 * 1024),
    "SANDBOX_SESSION_CLIENT_MAX_LAG_BYTES": str(24 * 1024 * 1024),
}


async def restart_mid_flood(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path, how: str
) -> tuple[bytes, bytes]:
    """A flood watched from offset 0; the worker restarted (`how`) mid-flood; the same shell
    answers afterwards. What the observer got and what the PTY wrote."""
    server = server_factory(**FLOOD_SERVER)
    agent = agent_factory(server)
    assert agent.proc is not None
    out = tmp_path / "pty-output.txt"  # the PTY's output, byte for byte, through `tee`
    pidfile = tmp_path / "shell.pid"
    cmd = [
        "sh",
        "-c",
        f"echo $$ > {pidfile}; stty -opost -echo; sleep 0.5; seq 1 {LINES} | tee {out}; "
        "echo FLOOD-DONE; while read l; do echo got:$l:$$; done",
    ]
    sid = create_session(server, agent.instance_id, cmd)
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, from_offset=0
    ) as watcher:
        await watcher.wait_offset(1_500_000, timeout=60)
        first = worker_of(agent)
        restarted = time.time()
        if how == "kill9":
            os.kill(first, signal.SIGKILL)  # the worker only: the keeper stays
        else:
            os.kill(agent.proc.pid, signal.SIGHUP)  # a planned restart (an upgrade)
        deadline = time.monotonic() + 30
        while worker_of(agent) == first:
            assert time.monotonic() < deadline, "the worker was not restarted"
            await asyncio.sleep(0.02)
        agent.wait_connected(60, since=restarted)
        await watcher.wait_output(b"FLOOD-DONE", timeout=120)
        assert not watcher.resyncs, f"resynced: {watcher.resyncs[:1]}"
        async with await PtyClient.connect(
            server.ws_url, sid, server.admin_token, role="control"
        ) as ctl:
            await ctl.send_input(b"again\n")
            pid = pidfile.read_text().strip()
            await watcher.wait_output(f"got:again:{pid}".encode(), timeout=30)  # the same shell
        got = bytes(watcher.data)
    assert server.ok("GET", f"/api/v2/admin/sessions/{sid}")["state"] == "running"
    assert "taken on from the previous worker" in agent.log_text()
    expected = out.read_bytes()
    assert len(expected) == sum(len(f"{i}\n") for i in range(1, LINES + 1))
    return got, expected


async def test_a_planned_restart_mid_flood_loses_no_byte_and_keeps_the_process(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    got, expected = await restart_mid_flood(server_factory, agent_factory, tmp_path, "sighup")
    assert hashlib.sha256(got[: len(expected)]).hexdigest() == (
        hashlib.sha256(expected).hexdigest()
    ), f"the observer's output differs from the PTY's: {first_difference(got, expected)}"
    assert got[len(expected) :].startswith(b"FLOOD-DONE")


async def test_a_worker_killed_mid_flood_keeps_the_process_and_loses_at_most_one_read(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    """A `kill -9` lands while the worker is inside a read as often as not: the kernel has
    handed it the bytes of that read (<= 4095 from a PTY) and it dies before it can record
    them. Everything else arrives, in order."""
    got, expected = await restart_mid_flood(server_factory, agent_factory, tmp_path, "kill9")
    got = got[: got.rindex(b"FLOOD-DONE")]
    n = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if n is None:
        assert got == expected
        return
    lost = len(expected) - len(got)
    assert 0 < lost <= 4095, first_difference(got, expected)
    assert got[n:] == expected[n + lost :], first_difference(got, expected)


async def test_a_planned_restart_keeps_sessions_and_a_later_exit_is_reported(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    agent = agent_factory(server)
    assert agent.proc is not None
    sid = create_session(server, agent.instance_id, ["sh", "-c", "read l; echo bye:$l; exit 7"])
    first = worker_of(agent)
    restarted = time.time()
    os.kill(agent.proc.pid, signal.SIGHUP)  # a planned restart: the worker hands over
    deadline = time.monotonic() + 30
    while worker_of(agent) == first:
        assert time.monotonic() < deadline, "the worker was not restarted"
        await asyncio.sleep(0.05)
    agent.wait_connected(60, since=restarted)
    assert "handing 1 sessions to the keeper" in agent.log_text()
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(b"now\n")
        await ctl.wait_output(b"bye:now")
        await ctl.wait_control("exit")
    # the keeper reaped it (its parent since the first worker left) and told the new worker
    info = wait_state(server, sid, ("exited",), timeout=30)
    assert info["exit_code"] == 7
