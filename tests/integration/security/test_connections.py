"""Slow and piled-up connections: a connection that never finishes its request head is closed
after the idle timeout, a body that does not arrive in time is a 408, one address holds at most
its cap of connections — and WebSocket and SSE streams still live as long as they like."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.support.agents import AgentProcess, start_agent
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sse import SseReader

pytestmark = pytest.mark.timeout(120)

IDLE = 1.0
CAP = 24


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    root = tmp_path_factory.mktemp("limits")
    env = {
        **TEST_SERVER_ENV,
        "SANDBOX_HTTP_IDLE_TIMEOUT_SECONDS": str(IDLE),
        "SANDBOX_HTTP_BODY_TIMEOUT_SECONDS": "1",
        "SANDBOX_HTTP_MAX_CONNECTIONS_PER_ADDRESS": str(CAP),
        "SANDBOX_SSE_KEEPALIVE_SECONDS": "0.3",
    }
    server = ServerProcess(root / "srv", env=env).start()
    agent: AgentProcess | None = None
    try:
        agent = start_agent(server, "limits-1", root)
        session = server.ok(
            "POST",
            "/api/v2/admin/sessions",
            {
                "instance_id": "limits-1",
                "command": ["bash", "--norc", "--noprofile", "-i"],
                "env": {"PS1": "PROMPT> "},
            },
        )
        yield server, str(session["id"])
    finally:
        if agent is not None:
            agent.stop()
        server.stop()


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sends until it closes the connection (or the deadline)."""
    got = bytearray()
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            break
        if not chunk:
            return bytes(got)
        got += chunk
    raise AssertionError(f"the server still holds the connection after {within}s: {got[:200]!r}")


async def test_half_open_connections_are_closed_after_the_idle_timeout(
    limited: tuple[ServerProcess, str],
) -> None:
    server, _ = limited
    conns = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(CAP - 4)]
    for i, (_, writer) in enumerate(conns):
        if i % 2:  # half of them send part of a request head and stop
            writer.write(b"GET /api/v2/admin/whoami HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
    await asyncio.gather(*(closed_by_server(r, IDLE + 10) for r, _ in conns))
    for _, writer in conns:
        writer.close()


async def test_a_body_that_does_not_arrive_in_time_is_a_408(
    limited: tuple[ServerProcess, str],
) -> None:
    server, _ = limited
    for path in ("/api/v2/admin/tokens", "/agents/limits-1/message:send"):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        writer.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {server.admin_token}\r\nA2A-Version: 1.0\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                '{"subj'
            ).encode()
        )
        await writer.drain()
        answer = await closed_by_server(reader, 15)
        assert answer.startswith(b"HTTP/1.1 408"), (path, answer[:300])
        assert b"did not arrive within" in answer, answer
        writer.close()


async def test_one_address_holds_at_most_its_cap_and_streams_outlive_the_idle_timeout(
    limited: tuple[ServerProcess, str],
) -> None:
    server, session = limited
    auth = {"Authorization": f"Bearer {server.admin_token}"}
    streams = [
        await SseReader.open(f"{server.url}/api/v1/events/stream", auth) for _ in range(CAP - 1)
    ]
    ws = await PtyClient.connect(server.ws_url, session, server.admin_token, role="control")
    try:
        # The cap is reached: the next connection is answered 429 and closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        answer = await closed_by_server(reader, 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 429"), answer[:300]
        assert b"Retry-After: " in answer and b"too-many-connections" in answer

        # Streams are not cut by the idle timeout: well past it, both still deliver.
        await asyncio.sleep(3 * IDLE)
        assert not any(s.ended.is_set() for s in streams) and not ws.closed.is_set()
        await ws.send_input(b"echo alive-$((3*3))\r")
        await ws.wait_output(b"alive-9")
        count = len(streams[0].frames)
        await streams[0].wait(lambda f: f.comment, after=count)

        # Closing streams frees their places.
        for s in streams[:2]:
            await s.close()
        deadline = time.monotonic() + 10
        while server.api("GET", "/healthz", token="")[0] != 200:
            assert time.monotonic() < deadline, "no place freed"
            await asyncio.sleep(0.05)
    finally:
        await ws.close()
        for s in streams:
            await s.close()
