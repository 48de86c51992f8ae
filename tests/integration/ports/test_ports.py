"""Ports against a real server and a real host agent: an HTTP server on a loopback port beside
the agent answers through the reverse proxy (bodies both ways, the server's credentials never
forwarded, the answer sandboxed) and through port forwarding (the SDK's and `sandboxctl
instance port-forward`); a WebSocket echoes through the proxy; a port nothing listens on is a
named error, not a hang; roles, other owners, the per-instance limit and the audit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yarl

from agentic_sandbox import AsyncClient, Client
from agentic_sandbox.sdk import ApiError
from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.polling import until, wait_until
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess, free_port
from tests.support.sessions import create_session, events
from tests.support.upstream import Upstream

pytestmark = pytest.mark.timeout(180)
MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[3]


def proxy_url(server: ServerProcess, iid: str, port: int, path: str = "") -> str:
    return f"{server.url}/api/v2/admin/instances/{iid}/ports/{port}/{path}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def fetch(
    method: str, url: str | yarl.URL, token: str, data: bytes | None = None, **kw: Any
) -> tuple[int, bytes, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url, data=data, headers=bearer(token), **kw) as resp,
    ):
        return resp.status, await resp.read(), resp.headers


async def test_http_answers_through_the_reverse_proxy(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream
) -> None:
    server, iid, port = sandbox_server, agent.instance_id, upstream.port
    token = server.admin_token
    raw = yarl.URL(proxy_url(server, iid, port, "hello?x=1&y=%2F"), encoded=True)  # as sent
    status, body, headers = await fetch("GET", raw, token)
    assert (status, body) == (200, b"hello from /hello?x=1&y=%2F")
    # the guest's page runs in an opaque origin: it cannot use the operator's cookie here
    assert headers["Content-Security-Policy"].startswith("sandbox ")
    assert "allow-same-origin" not in headers["Content-Security-Policy"]

    # what the guest got: none of the server's credentials, its own Host, the prefix
    cookies = {"sbx_session": "secret-session", "app": "kept"}
    async with (
        aiohttp.ClientSession(cookies=cookies) as http,
        http.get(
            proxy_url(server, iid, port, "headers"),
            headers={**bearer(token), "X-CSRF-Token": "csrf-secret"},
        ) as resp,
    ):
        assert resp.status == 200
        seen = await resp.json()
    assert "authorization" not in seen and "x-csrf-token" not in seen
    assert "secret-session" not in str(seen) and token not in str(seen)
    assert seen["cookie"] == "app=kept"
    assert seen["host"] == f"localhost:{port}"
    assert seen["x-forwarded-prefix"] == f"/api/v2/admin/instances/{iid}/ports/{port}"

    # a body both ways, streamed (bigger than any window)
    payload = os.urandom(3 * MiB)
    status, body, _ = await fetch("POST", proxy_url(server, iid, port, "echo"), token, payload)
    assert status == 200 and body == payload
    status, body, _ = await fetch("GET", proxy_url(server, iid, port, f"bytes?n={5 * MiB}"), token)
    assert status == 200 and len(body) == 5 * MiB

    # the port's root without a slash is sent to the slash (relative links need it)
    status, _, headers = await fetch(
        "GET", proxy_url(server, iid, port).rstrip("/"), token, allow_redirects=False
    )
    assert status == 308 and headers["Location"].endswith(f"/ports/{port}/")
    # the guest's own 404 passes through as the guest's
    status, _, _ = await fetch("GET", proxy_url(server, iid, port, "nothing-here"), token)
    assert status == 404


async def test_a_websocket_echoes_through_the_proxy(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream
) -> None:
    url = proxy_url(sandbox_server, agent.instance_id, upstream.port, "ws")
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(
            url, headers=bearer(sandbox_server.admin_token), protocols=("echo.v1",)
        ) as ws,
    ):
        assert ws.protocol == "echo.v1"
        await ws.send_str("ping")
        assert (await ws.receive(timeout=30)).data == "ping"
        blob = os.urandom(300 * 1024)
        await ws.send_bytes(blob)
        assert (await ws.receive(timeout=30)).data == blob
        # a burst much bigger than every window on the way, read while it is sent: it all
        # comes back, in order (flow control end to end, nothing dropped or stuck)
        burst = [os.urandom(256 * 1024) for _ in range(40)]

        async def send_all() -> None:
            for b in burst:
                await ws.send_bytes(b)

        sender = asyncio.ensure_future(send_all())
        for b in burst:
            assert (await ws.receive(timeout=60)).data == b
        await sender


async def test_port_forward_through_the_sdk(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream
) -> None:
    async with AsyncClient(sandbox_server.url, sandbox_server.admin_token) as client:
        async with await client.instances.port_forward(agent.instance_id, upstream.port) as fwd:
            host, local = fwd.address
            assert host == "127.0.0.1"
            async with aiohttp.ClientSession() as http:
                for i in range(3):  # one tunnel per connection
                    async with http.get(
                        f"http://127.0.0.1:{local}/hello?n={i}",
                        headers={"Connection": "close"},
                    ) as resp:
                        assert resp.status == 200
                        assert await resp.read() == f"hello from /hello?n={i}".encode()
                async with http.get(f"http://127.0.0.1:{local}/bytes?n={4 * MiB}") as resp:
                    assert len(await resp.read()) == 4 * MiB
            assert fwd.connections >= 4 and not fwd.failures
        # a raw tunnel: the port answers only once it reads our half-close
        async with await client.instances.tunnel(agent.instance_id, upstream.eof_port) as t:
            await t.write(b"x" * 100_000)
            await t.write_eof()
            got = b""
            while data := await t.read():
                got += data
            assert got == b"got 100000 bytes" and not t.error
    # the blocking client does the same
    with (
        Client(sandbox_server.url, sandbox_server.admin_token) as sync,
        sync.instances.port_forward(agent.instance_id, upstream.port) as fwd,
    ):
        url = f"http://127.0.0.1:{fwd.address[1]}/hello"
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.read() == b"hello from /hello"


def _default_sigint() -> None:
    """In the child: Ctrl-C as at a terminal. A test run started in the background by a
    non-interactive shell inherits SIGINT ignored, and Python then installs no handler, so
    the SIGINT these tests send would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sandboxctl_port_forward(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update(
        SANDBOX_URL=sandbox_server.url,
        SANDBOX_TOKEN=sandbox_server.admin_token,
        XDG_CONFIG_HOME=str(tmp_path),
    )
    argv = [sys.executable, "-m", "agentic_sandbox.sandboxctl.main", "instance", "port-forward"]
    proc = subprocess.Popen(
        [*argv, agent.instance_id, f"0:{upstream.port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        m = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> (\S+):(\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        assert m.group(2) == agent.instance_id and int(m.group(3)) == upstream.port
        url = f"http://127.0.0.1:{m.group(1)}/hello"
        for _ in range(2):
            with urllib.request.urlopen(url, timeout=30) as resp:
                assert resp.read() == b"hello from /hello"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)

    # a port nothing listens on: said at once, by name, before listening
    nothing = free_port()
    done = subprocess.run(
        [*argv, agent.instance_id, str(nothing)],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode != 0
    assert b"nothing listens on" in done.stderr, done.stderr
    done = subprocess.run(
        [*argv, agent.instance_id, "70000"], capture_output=True, env=env, cwd=ROOT, timeout=60
    )
    assert done.returncode != 0 and b"1-65535" in done.stderr


async def test_a_refused_port_is_a_named_error_not_a_hang(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    server, iid = sandbox_server, agent.instance_id
    nothing = free_port()
    started = time.monotonic()
    status, body, _ = await fetch("GET", proxy_url(server, iid, nothing, "x"), server.admin_token)
    import json

    doc = json.loads(body)
    assert status == 502 and doc["code"] == "connection-refused", doc
    assert f"127.0.0.1:{nothing}" in doc["detail"] and doc["port"] == nothing
    assert time.monotonic() - started < 20
    async with AsyncClient(server.url, server.admin_token) as client:
        with pytest.raises(ApiError) as refused:
            await client.instances.tunnel(iid, nothing)
        assert refused.value.status == 502 and refused.value.code == "connection-refused"
    for bad in ("0", "65536", "http"):
        status, body, _ = await fetch(
            "GET", proxy_url(server, iid, 0, "").replace("/0/", f"/{bad}/"), server.admin_token
        )
        assert status == 422 and json.loads(body)["code"] == "bad-port", (bad, body)


async def test_operators_open_ports_viewers_and_other_owners_do_not(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream
) -> None:
    server, iid = sandbox_server, agent.instance_id
    owner = server.ok("GET", f"/api/v2/admin/instances/{iid}")["owner"]
    operator = server.make_token(owner, "operator")
    viewer = server.make_token(owner, "viewer")
    other = server.make_token(unique_id("ports-other"), "operator")
    url = proxy_url(server, iid, upstream.port, "hello")
    assert (await fetch("GET", url, operator))[0] == 200
    status, body, _ = await fetch("GET", url, viewer)
    assert status == 403 and b"forbidden-role" in body
    assert (await fetch("GET", url, other))[0] == 404
    async with AsyncClient(server.url, other) as client:
        with pytest.raises(ApiError) as hidden:
            await client.instances.tunnel(iid, upstream.port)
        assert hidden.value.status == 404
    # no credential at all
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 401

    def audited() -> list[dict[str, Any]]:
        page = server.ok("GET", f"/api/v2/admin/audit?subject_id={iid}&limit=1000")
        return [e for e in page["items"] if e["action"] == "instance.port.open"]

    wait_until(lambda: any(e["outcome"] == "ok" for e in audited()), "the opens audited")
    opened = events(server, "instance.port.opened", instance_id=iid)
    assert opened and opened[0]["data"]["port"] == upstream.port, opened


async def test_the_per_instance_limit_is_a_429_naming_it(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory(SANDBOX_PORTS_MAX_STREAMS_PER_INSTANCE="1")
    iid = agent_factory(server, unique_id("ports-limit")).instance_id
    with Upstream() as up:
        async with AsyncClient(server.url, server.admin_token) as client:
            async with await client.instances.tunnel(iid, up.port):
                status, body, headers = await fetch(
                    "GET", proxy_url(server, iid, up.port, "hello"), server.admin_token
                )
                assert status == 429 and b"too-many-port-streams" in body
                assert b"SANDBOX_PORTS_MAX_STREAMS_PER_INSTANCE" in body
                assert headers["Retry-After"]

            # the place is free again once the tunnel closed
            async def answered() -> int:
                return (
                    await fetch("GET", proxy_url(server, iid, up.port, "hello"), server.admin_token)
                )[0]

            deadline = time.monotonic() + 15
            while (code := await answered()) != 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert code == 200


async def test_a_keystroke_echo_arrives_while_a_port_stream_floods_the_link(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream
) -> None:
    """Port streams share the link fairly with sessions: a session's echo still arrives while a
    proxied download floods the same agent link."""
    server, iid = sandbox_server, agent.instance_id
    sid = create_session(server, iid, ["cat"])
    got = {"bytes": 0}
    total = 512 * MiB  # bounded: the flood ends by itself

    async def flood() -> None:
        url = proxy_url(server, iid, upstream.port, f"bytes?n={total}")
        async with (
            aiohttp.ClientSession() as http,
            http.get(url, headers=bearer(server.admin_token)) as resp,
        ):
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                got["bytes"] += len(chunk)

    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        task = asyncio.ensure_future(flood())
        try:
            await until(lambda: got["bytes"] > 8 * MiB, "the flood started", timeout=60)
            for i in range(5):
                await ctl.send_input(f"key-{i}\r".encode())
                await ctl.wait_output(f"key-{i}".encode(), timeout=30)
                assert not task.done(), "the flood ended before the echo arrived"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert 8 * MiB < got["bytes"] < total


def test_sandboxctl_port_forward_stops_at_ctrl_c_with_tunnels_open(
    sandbox_server: ServerProcess, agent: AgentProcess, upstream: Upstream, tmp_path: Path
) -> None:
    """Ctrl-C ends `port-forward` even while its tunnels are open and idle (a browser keeps
    connections alive): they are closed together, not each waiting out a close handshake."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update(
        SANDBOX_URL=sandbox_server.url,
        SANDBOX_TOKEN=sandbox_server.admin_token,
        XDG_CONFIG_HOME=str(tmp_path),
    )
    argv = [sys.executable, "-m", "agentic_sandbox.sandboxctl.main", "instance", "port-forward"]
    proc = subprocess.Popen(
        [*argv, agent.instance_id, f"0:{upstream.port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        preexec_fn=_default_sigint,
    )
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        m = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> ", line)
        assert m, line
        opened = len(events(sandbox_server, "instance.port.opened"))
        for _ in range(4):  # idle connections: each holds a tunnel open
            held.append(socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=30))
        wait_until(
            lambda: len(events(sandbox_server, "instance.port.opened")) >= opened + 4,
            "the four tunnels open",
            timeout=60,
        )
        proc.send_signal(signal.SIGINT)
        proc.wait(20)  # (a guard against a hang, not a speed limit: it exits at once)
        assert b"port-forward stopped" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
