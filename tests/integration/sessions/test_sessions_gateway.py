"""Agents that come in through a guest forward (one pipe for all their connections, as QEMU's
`guestfwd` gives the host) enroll, connect, and come back at once after a server restart: the
gateway ends the stale connection in the pipe instead of letting it time out."""

from __future__ import annotations

import time
from pathlib import Path

from agentic_sandbox.broker.agentlink.gateway import RESET
from tests.support.agents import register_host_instance, start_agent
from tests.support.fixtures import ServerFactory
from tests.support.guestfwd import GuestForward
from tests.support.ptyclient import PtyClient
from tests.support.sessions import SHELL, create_session, events


def _ts(line: str) -> float:
    import datetime as dt
    import json

    try:
        return dt.datetime.fromisoformat(json.loads(line)["time"]).timestamp()
    except (ValueError, KeyError):
        return 0.0


async def test_an_agent_behind_a_guest_forward_enrolls_connects_and_survives_a_restart(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory()
    fwd = GuestForward(server.guest_link_target).start()
    iid = "through-fwd"
    try:
        # enrollment and the link, one after the other, on one pipe
        agent = start_agent(server, iid, tmp_path, extra_args=["--gateway", fwd.address])
        sid = create_session(server, iid, SHELL)
        async with await PtyClient.connect(
            server.ws_url, sid, server.admin_token, role="control"
        ) as c:
            await c.send_input(b"echo one-$((40+2))\r")
            await c.wait_output(b"one-42")

        server.kill9()
        down_at = time.time()
        server.start()
        agent.wait_connected(since=down_at)  # back through the re-made pipe
        assert fwd.pipes_made >= 2
        async with await PtyClient.connect(
            server.ws_url, sid, server.admin_token, role="control", from_offset=0
        ) as c:
            await c.send_input(b"echo two-$((40+3))\r")
            await c.wait_output(b"two-43")
            assert b"one-42" in bytes(c.data)  # the session and its output survived
        assert events(server, "agent.connected", instance_id=iid)

        # QEMU re-makes the pipe under a live link (a restore, a chardev reconnect): the guest's
        # connection is still open but leads nowhere. The gateway's first words on a new pipe
        # end it at once — the link fails on them, not on the silence timeout (≥ 5 s).
        remade_at = time.time()
        fwd.remake_pipe()
        agent.wait_connected(since=remade_at)
        failures = [
            line
            for line in agent.log_text().splitlines()
            if "link failed" in line and _ts(line) >= remade_at
        ]
        assert failures and "silent for" not in failures[0], failures
        agent.stop()
    finally:
        fwd.stop()


async def test_what_waits_in_the_pipe_never_reaches_the_agents_next_connection(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """A warm-pool member is restored paused: QEMU makes its pipe while the guest has no
    connection open, and the gateway's reset waits in it for the guest's next connection
    (slirp reads the pipe only into one). The agent syncs the pipe before it connects, so its
    enrollment and its link succeed at the first try."""
    server = server_factory()
    fwd = GuestForward(server.guest_link_target).start()
    iid = "pool-like"
    try:
        register_host_instance(server, iid)
        deadline = time.monotonic() + 10
        while bytes(fwd.held) != RESET:  # the pipe is made, its reset waits
            assert time.monotonic() < deadline, fwd.held
            time.sleep(0.01)
        agent = start_agent(
            server, iid, tmp_path, register=False, extra_args=["--gateway", fwd.address]
        )
        log = agent.log_text()
        assert "enrollment failed" not in log and "link failed" not in log, log
        assert "HTTP proxy returned response code" not in log, log
        agent.stop()
    finally:
        fwd.stop()
