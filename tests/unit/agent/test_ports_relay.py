"""The agent's port streams, both stream sides in one process (the server's `LinkStreams`, the
agent's `StreamTable` with the real `port` opener) and a real listener on a loopback port: bytes
both ways with half-close, the byte counts in the result, and the refusals by name (a port out
of range, nothing listening) — before any accept, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from collections.abc import AsyncIterator

import pytest

from agentic_sandbox.agent.ports import PortRelay
from agentic_sandbox.agent.streams import StreamTable
from agentic_sandbox.broker.agentlink import PortConnected, PortResult, PortSpec
from agentic_sandbox.broker.agentlink.streams import LinkStreams, ServerStream
from agentic_sandbox.broker.agentlink.streams import StreamRefused as ServerRefused
from agentic_sandbox.proto import agent_pb2 as pb


class Link:
    """Both tables, and a task that carries frames between them until stopped."""

    def __init__(self) -> None:
        self.to_agent: deque[pb.ServerMessage] = deque()
        self.wake = asyncio.Event()
        self.server = LinkStreams(self.to_agent.append, self.wake.set)
        self.agent = StreamTable({"port": PortRelay.open}, wake=self.wake.set)

    def deliver(self) -> None:
        while self.to_agent or (msg := self.server.next_message()) is not None:
            out = self.to_agent.popleft() if self.to_agent else msg
            self.agent.receive(out.stream)
        while (a := self.agent.next_control() or self.agent.next_data()) is not None:
            self.server.receive(a.stream)

    async def run(self) -> None:
        while True:
            self.deliver()
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 0.05)

    def open(self, port: int) -> ServerStream:
        return self.server.open(PortSpec(port))


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    lk = Link()
    task = asyncio.ensure_future(lk.run())
    yield lk
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_bytes_go_both_ways_and_the_result_counts_them(link: Link) -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    payload = os.urandom(3 * 1024 * 1024)  # many windows' worth
    try:
        stream = link.open(port)
        assert isinstance(await asyncio.wait_for(stream.started(), 10), PortConnected)

        async def send() -> None:
            await stream.write(0, payload)
            await stream.end(0)

        sender = asyncio.ensure_future(send())
        got = bytearray()
        eof = False
        async with asyncio.timeout(30):
            while (chunk := await stream.read()) is not None:
                assert chunk.channel == 1
                got += chunk.data
                eof = eof or chunk.eof
            result = await stream.result()
        await sender
        assert bytes(got) == payload and eof
        assert result == PortResult(bytes_in=len(payload), bytes_out=len(payload))
    finally:
        server.close()


@pytest.mark.parametrize("port", [0, 65536, 1 << 31])
async def test_a_port_out_of_range_is_refused_by_name(link: Link, port: int) -> None:
    stream = link.open(port)
    with pytest.raises(ServerRefused) as refused:
        await asyncio.wait_for(stream.started(), 10)
    assert refused.value.code == "bad-port" and refused.value.field == "port"
    assert len(link.agent) == 0


async def test_nothing_listening_is_connection_refused_before_any_accept(link: Link) -> None:
    port = _free_port()
    stream = link.open(port)
    with pytest.raises(ServerRefused) as refused:
        await asyncio.wait_for(stream.started(), 10)
    assert refused.value.code == "connection-refused"
    assert f"127.0.0.1:{port}" in refused.value.message
    assert len(link.agent) == 0


async def test_a_cancel_closes_the_connection(link: Link) -> None:
    closed = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the agent's side goes away
        closed.set()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        stream = link.open(server.sockets[0].getsockname()[1])
        await asyncio.wait_for(stream.started(), 10)
        stream.cancel("canceled", "the caller went away")
        await asyncio.wait_for(closed.wait(), 10)
        async with asyncio.timeout(10):
            while len(link.agent):
                await asyncio.sleep(0.01)
    finally:
        server.close()
