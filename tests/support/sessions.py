"""Small helpers shared by the session integration tests."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from typing import Any

from tests.support.server import ServerProcess

SHELL = ["bash", "--norc", "--noprofile", "-i"]
SHELL_ENV = {"PS1": "PROMPT> ", "HISTFILE": "/dev/null"}


def create_session(
    server: ServerProcess,
    instance_id: str,
    command: list[str] | None = None,
    *,
    token: str | None = None,
    **extra: Any,
) -> str:
    body: dict[str, Any] = {"instance_id": instance_id, **extra}
    if command is not None:
        body["command"] = command
    if command == SHELL:
        body.setdefault("env", SHELL_ENV)
    out = server.ok("POST", "/api/v2/admin/sessions", body, token=token)
    assert out["state"] in ("running", "exited"), out
    return str(out["id"])


def first_difference(got: bytes, expected: bytes) -> str:
    """Where an observer's bytes first differ from what the PTY wrote, and by how much."""
    n = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if n is None:
        return f"lengths {len(got)} and {len(expected)}"
    resumes = expected.find(got[n : n + 64], n)
    return (
        f"at byte {n}: got {got[n - 20 : n + 40]!r}, expected {expected[n - 20 : n + 40]!r}; "
        f"got continues at expected byte {resumes} ({resumes - n} bytes lost); "
        f"lengths {len(got)} and {len(expected)}"
    )


def wait_state(
    server: ServerProcess, session_id: str, states: tuple[str, ...], timeout: float = 20.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info: dict[str, Any] = server.ok("GET", f"/api/v2/admin/sessions/{session_id}")
        if info["state"] in states:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"session {session_id} stayed {info['state']}")
        time.sleep(0.05)


def events(server: ServerProcess, type_: str, **filters: str) -> list[dict[str, Any]]:
    query = "&".join([f"type={type_}", "limit=200", *(f"{k}={v}" for k, v in filters.items())])
    out: dict[str, Any] = server.ok("GET", f"/api/v1/events?{query}")
    items: list[dict[str, Any]] = out["items"]
    return items


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    status, body = server.api("GET", "/metrics")
    assert status == 200
    text = body.decode() if isinstance(body, bytes) else str(body)
    prefix = f"{name}{{{labels}}}" if labels else name
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix + " ") or (not labels and line.startswith(name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


class RawWebSocket:
    """A bare-bones WebSocket client on a socket with a tiny receive buffer, so that not
    reading really stalls the server's sends (no kernel buffering of megabytes)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(
        cls, server: ServerProcess, session_id: str, token: str, query: str = "role=observe"
    ) -> RawWebSocket:
        import socket

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.http_port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET /api/v2/admin/sessions/{session_id}/attach?{query} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{server.http_port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Protocol: sandbox.pty.v1, bearer.{token}\r\n\r\n"
        )
        writer.write(request.encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(reader, writer)

    async def frame(self, timeout: float = 10.0) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame (server frames are not masked)."""

        async def read() -> tuple[int, bytes]:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(await self.reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await self.reader.readexactly(8), "big")
            return b0 & 0x0F, await self.reader.readexactly(n)

        return await asyncio.wait_for(read(), timeout)

    def close(self) -> None:
        self.writer.close()


async def stalled_client(
    server: ServerProcess, session_id: str, token: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket client that completes the handshake and then never reads again."""
    ws = await RawWebSocket.connect(server, session_id, token)
    return ws.reader, ws.writer
