"""A follower's agent-link listeners that fail to bind half-way let go of the port they did
bind: gRPC binds at `add_*_port` and only a started server's stop closes the socket, so the
port was held until the process ended — and the node, elected later, could not listen on it
("starting as the leader failed": address already in use)."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from agentic_sandbox.broker.agentlink.redirect import FollowerLink
from tests.support.server import free_port


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_a_bind_that_fails_half_way_keeps_no_port() -> None:
    first = free_port()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # the second address is someone else's
    taken.listen()

    def bind(server: grpc.aio.Server) -> dict[str, int]:
        ports = {"link": server.add_insecure_port(f"127.0.0.1:{first}")}
        assert not bindable(first)  # bound at once
        server.add_insecure_port(f"127.0.0.1:{taken.getsockname()[1]}")  # raises: in use
        return ports

    link = FollowerLink(SimpleNamespace())  # type: ignore[arg-type]
    try:
        with pytest.raises(RuntimeError, match="Failed to bind"):
            await link.start(bind)
    finally:
        taken.close()
    assert bindable(first), "the port bound before the failure is still held"


async def test_the_listeners_release_their_ports_when_stopped() -> None:
    port = free_port()
    link = FollowerLink(SimpleNamespace())  # type: ignore[arg-type]

    def bind(server: Any) -> dict[str, int]:
        return {"link": server.add_insecure_port(f"127.0.0.1:{port}")}

    await link.start(bind)
    assert not bindable(port)
    await link.stop()
    assert bindable(port)
