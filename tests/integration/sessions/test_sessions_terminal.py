"""A terminal shared over WebSockets: one controller, observers, the lease, resize, exit, kill.

Real server subprocess, real agent-client process, real PTYs, real gRPC over mutual TLS.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.polling import until
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import SHELL, create_session, events, wait_state

pytestmark = pytest.mark.timeout(180)


async def test_echo_reaches_controller_and_every_observer(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    tok = server.admin_token
    async with (
        await PtyClient.connect(server.ws_url, sid, tok, role="control", from_offset=0) as ctl,
        await PtyClient.connect(server.ws_url, sid, tok, role="observe", from_offset=0) as ob1,
        await PtyClient.connect(server.ws_url, sid, tok, role="observe") as ob2,
    ):
        assert ctl.hello["role"] == "controller"
        assert ob1.hello["role"] == "observer" and ob2.hello["role"] == "observer"
        await ctl.wait_output(b"PROMPT> ")
        await ctl.send_input(b"echo one-$((40+2))\r")
        for client in (ctl, ob1, ob2):
            await client.wait_output(b"one-42")
        # Observers see the same bytes at the same offsets as the controller.
        await ob1.wait_offset(ctl.next or 0)
        assert ctl.start == ob1.start == 0
        assert bytes(ob1.data) == bytes(ctl.data)[: len(ob1.data)]
        assert (await ob2.wait_control("resync"))["reason"] == "initial"  # a snapshot, then live

        # An observer's input and resize are refused and never reach the PTY.
        n_err = len(ob1.errors())
        await ob1.send_input(b"echo OBSERVER-WROTE-THIS\r")
        await ob1.send_json({"type": "resize", "cols": 133, "rows": 41})
        await until(lambda: len(ob1.errors()) >= n_err + 2, "both refusals", timeout=15)
        assert [e["code"] for e in ob1.errors()[n_err:]] == ["not-controller"] * 2
        await ctl.send_input(b"stty size; echo after-$((1+1))\r")
        await ctl.wait_output(b"after-2")
        assert b"OBSERVER-WROTE-THIS" not in ctl.data
        assert b"24 80" in ctl.data
        assert b"41 133" not in ctl.data

        # Members: one controller and two observers, all the bootstrap admin.
        info = server.ok("GET", f"/api/v2/admin/sessions/{sid}")
        roles = sorted(m["role"] for m in info["members"])
        assert roles == ["controller", "observer", "observer"]
        assert info["controller"] == "admin"


async def test_resize_is_broadcast_and_applied(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    tok = server.admin_token
    async with (
        await PtyClient.connect(server.ws_url, sid, tok, role="control") as ctl,
        await PtyClient.connect(server.ws_url, sid, tok) as obs,
    ):
        await ctl.send_json({"type": "resize", "cols": 100, "rows": 30})
        for client in (ctl, obs):
            msg = await client.wait_control("resize")
            assert (msg["cols"], msg["rows"]) == (100, 30)
        await ctl.send_input(b"stty size\r")
        await ctl.wait_output(b"30 100")
        screen = server.ok("GET", f"/api/v2/admin/sessions/{sid}/screen")
        assert (screen["cols"], screen["rows"]) == (100, 30)
        assert server.ok("GET", f"/api/v2/admin/sessions/{sid}")["cols"] == 100


async def test_control_lease_force_release_and_disconnect(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    tok = server.admin_token
    a = await PtyClient.connect(server.ws_url, sid, tok, role="control")
    b = await PtyClient.connect(server.ws_url, sid, tok, role="control")
    try:
        assert a.hello["role"] == "controller"
        # The lease is taken: b is an observer and is told why.
        assert b.hello["role"] == "observer"
        await b.wait_control("error", pred=lambda e: e["code"] == "control-held")
        await b.send_json({"type": "request_control"})
        await b.wait_control("error", pred=lambda e: e["code"] == "control-held", after=2)
        # Forced takeover: b controls, a is told it is now an observer.
        await b.send_json({"type": "request_control", "force": True})
        await b.wait_control("role", pred=lambda r: r["role"] == "controller")
        await a.wait_control("role", pred=lambda r: r["role"] == "observer")
        n = len(a.errors())
        await a.send_input(b"echo A-AFTER-TAKEOVER\r")
        await a.wait_control("error", pred=lambda e: e["code"] == "not-controller", after=0)
        assert len(a.errors()) == n + 1
        await b.send_input(b"echo b-$((2*3))\r")
        await a.wait_output(b"b-6")
        assert b"A-AFTER-TAKEOVER" not in a.data
        # Release: nobody controls; a asks (without force) and gets it.
        await b.send_json({"type": "release_control"})
        await b.wait_control("role", pred=lambda r: r["role"] == "observer")
        await a.send_json({"type": "request_control"})
        await a.wait_control("role", pred=lambda r: r["role"] == "controller")
        # The controller disconnects: the lease is free again.
        await a.close()
        await until(
            lambda: server.ok("GET", f"/api/v2/admin/sessions/{sid}")["controller"] is None,
            "the lease freed after the controller left",
            timeout=15,
        )
        before = len(b.controls)
        await b.send_json({"type": "request_control"})
        await b.wait_control("role", pred=lambda r: r["role"] == "controller", after=before)
        control_events = events(server, "session.control", session_id=sid)
        assert any(e["data"].get("forced") for e in control_events)
        assert any(e["data"].get("reason") == "controller disconnected" for e in control_events)
    finally:
        await a.close()
        await b.close()


async def test_viewer_observes_only_and_strangers_see_nothing(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    viewer = server.make_token("admin", "viewer")  # sees admin's objects, may not control
    stranger = server.make_token(unique_id("bob"), "operator")
    async with await PtyClient.connect(server.ws_url, sid, viewer, role="control") as v:
        assert v.hello["role"] == "observer"
        await v.wait_control("error", pred=lambda e: e["code"] == "forbidden")
        await v.send_json({"type": "request_control", "force": True})
        await v.wait_control("error", pred=lambda e: e["code"] == "forbidden", after=2)
        await v.send_input(b"echo nope\r")
        await v.wait_control("error", pred=lambda e: e["code"] == "not-controller")
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await PtyClient.connect(server.ws_url, sid, stranger, role="observe")
    assert err.value.status == 404
    status, _ = server.api("GET", f"/api/v2/admin/sessions/{sid}", token=stranger)
    assert status == 404
    status, _ = server.api("POST", f"/api/v2/admin/sessions/{sid}/kill", token=viewer)
    assert status == 403
    # No token at all, and a wrong subprotocol.
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await PtyClient.connect(server.ws_url, sid, None)
    assert err.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await PtyClient.connect(
            server.ws_url, sid, None, subprotocols=("other.v1", f"bearer.{server.admin_token}")
        )
    assert err.value.status == 400


async def test_exit_code_signal_and_kill(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    tok = server.admin_token

    sid = create_session(server, agent.instance_id, ["sh", "-c", "sleep 0.5; echo bye; exit 7"])
    async with await PtyClient.connect(server.ws_url, sid, tok, from_offset=0) as c:
        ex = await c.wait_control("exit", timeout=20)
        assert ex["code"] == 7 and ex["signal"] is None
        assert b"bye" in c.data
        await asyncio.wait_for(c.closed.wait(), 10)
    info = wait_state(server, sid, ("exited",))
    assert info["exit_code"] == 7

    sid = create_session(server, agent.instance_id, ["sleep", "600"])
    async with await PtyClient.connect(server.ws_url, sid, tok, role="control") as c:
        await c.send_json({"type": "signal", "signal": "TERM"})
        ex = await c.wait_control("exit", timeout=20)
        assert ex["code"] is None and ex["signal"] == "TERM"

    sid = create_session(server, agent.instance_id, ["sleep", "600"])
    out = server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    assert out["state"] in ("killing", "exited")
    info = wait_state(server, sid, ("exited",))
    assert info["exit_signal"] in ("HUP", "KILL")
    assert events(server, "session.exited", session_id=sid)

    # A command that does not exist: a clear 422, the session is recorded as failed.
    status, problem = server.api(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": agent.instance_id, "command": ["/no/such/program"]},
    )
    assert status == 422 and problem["code"] == "session-start-failed"
    assert "/no/such/program" in problem["detail"]


async def test_user_cwd_env_and_login_shell(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)  # runs as root here, so it may switch users
    sid = create_session(
        server,
        agent.instance_id,
        ["sh", "-c", 'echo "who=$(id -un) cwd=$(pwd) foo=$FOO home=$HOME term=$TERM"'],
        user="nobody",
        cwd="/tmp",
        env={"FOO": "bar baz"},
    )
    async with await PtyClient.connect(server.ws_url, sid, server.admin_token, from_offset=0) as c:
        await c.wait_control("exit")
        line = bytes(c.data).decode()
    assert "who=nobody cwd=/tmp foo=bar baz" in line
    assert "term=xterm-256color" in line
    # No command: the user's login shell (HOME elsewhere: this machine's root profile is slow).
    sid = create_session(server, agent.instance_id, None, env={"PS1": "LOGIN> ", "HOME": "/tmp"})
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as c:
        await c.send_input(b"echo shell=$0; exit\r")
        await c.wait_output(b"shell=")
        await c.wait_control("exit")
    status, problem = server.api(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": agent.instance_id, "command": ["true"], "user": "no-such-user"},
    )
    assert status == 422 and "no such user" in problem["detail"]


async def test_graceful_shutdown_with_clients_and_agents_attached(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    client = await PtyClient.connect(server.ws_url, sid, server.admin_token, role="control")
    started = time.monotonic()
    code = await asyncio.get_running_loop().run_in_executor(None, server.stop)
    assert code == 0, server.log_tail()
    assert time.monotonic() - started < 8
    await asyncio.wait_for(client.closed.wait(), 5)
    await client.close()
    assert agent.alive(), "the agent outlives the server"
    server.start()
    agent.wait_connected(since=time.time() - 1)
    assert server.ok("GET", f"/api/v2/admin/sessions/{sid}")["state"] == "running"
