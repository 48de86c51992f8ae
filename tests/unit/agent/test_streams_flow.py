"""The byte-stream layer, both sides in one process: the server's `LinkStreams` and the agent's
`StreamTable`, joined by a pump that delivers every frame (as the one Connect stream would).

What a user of streams relies on: a sender never exceeds the credit it was granted; a consumer
that stops reading stalls only its own stream; half-close, cancel and refusals arrive with
their codes; a peer that breaks the protocol is cut off; a lost link fails every waiter.
"""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from agentic_sandbox.agent import streams as agent_streams
from agentic_sandbox.agent.streams import Stream, StreamRefused, StreamTable
from agentic_sandbox.broker.agentlink import ExecSpec, ExecStarted
from agentic_sandbox.broker.agentlink import streams as server_streams
from agentic_sandbox.broker.agentlink.streams import (
    LinkStreams,
    StreamLost,
    TooManyStreams,
)
from agentic_sandbox.broker.agentlink.streams import StreamRefused as ServerRefused
from agentic_sandbox.proto import agent_pb2 as pb

WINDOW = agent_streams.WINDOW


class Producer:
    """Agent-side handler: writes `total` bytes on channel 1 as credit allows, then closes."""

    def __init__(self, stream: Stream, total: int) -> None:
        self.stream = stream
        self.left = total
        self.sent = 0
        self.closed_with: pb.StreamError | None = None
        self.received: dict[int, bytearray] = {}
        self.eof: set[int] = set()
        self.consume = True

    def pump(self) -> None:
        while self.left > 0:
            n = min(self.stream.room(1), agent_streams.CHUNK, self.left)
            if n <= 0:
                return
            self.stream.send(1, b"x" * n)
            self.left -= n
            self.sent += n
        self.stream.send(1, b"", eof=True)
        self.stream.finish(pb.StreamClose())
        self.left = -1

    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        self.received.setdefault(channel, bytearray()).extend(data)
        if eof:
            self.eof.add(channel)
        if self.consume:
            self.stream.consumed(channel, len(data))

    def on_credit(self, channel: int) -> None:
        if self.left > 0:
            self.pump()

    def on_close(self, error: pb.StreamError | None) -> None:
        self.closed_with = error
        self.stream.finish(pb.StreamClose(error=pb.StreamError(code="canceled")))


class Pair:
    def __init__(self, total: int = 0, *, agent_max: int = 64, server_max: int = 128) -> None:
        self.to_agent: deque[pb.ServerMessage] = deque()
        self.server = LinkStreams(self.to_agent.append, lambda: None, max_streams=server_max)
        self.handlers: list[Producer] = []
        self.total = total
        self.refuse: StreamRefused | None = None
        self.agent = StreamTable({"exec": self._open}, wake=lambda: None, max_streams=agent_max)

    def _open(self, stream: Stream, msg: pb.StreamOpen) -> tuple[Producer, pb.StreamAccept]:
        if self.refuse is not None:
            raise self.refuse
        handler = Producer(stream, self.total)
        self.handlers.append(handler)
        return handler, pb.StreamAccept(exec=pb.ExecStarted(pid=42))

    def deliver(self) -> bool:
        moved = False
        while self.to_agent:
            self.agent.receive(self.to_agent.popleft().stream)
            moved = True
        msg = self.server.next_message()
        while msg is not None:
            self.agent.receive(msg.stream)
            moved = True
            msg = self.server.next_message()
        for handler in self.handlers:
            if handler.left > 0:
                handler.pump()
        out = self.agent.next_control() or self.agent.next_data()
        while out is not None:
            self.server.receive(out.stream)
            moved = True
            out = self.agent.next_control() or self.agent.next_data()
        return moved

    async def settle(self) -> None:
        """Deliver until nothing moves any more (every task has had its turns)."""
        idle = 0
        while idle < 20:
            idle = 0 if self.deliver() else idle + 1
            await asyncio.sleep(0)

    def open(self) -> server_streams.ServerStream:
        return self.server.open(pb.StreamOpen(exec=pb.ExecSpec(argv=["x"])))


async def test_a_stream_delivers_everything_within_its_windows() -> None:
    pair = Pair(total=3 * 1024 * 1024 + 7)
    stream = pair.open()
    await pair.settle()
    accept = await stream.accepted()
    assert accept.exec.pid == 42 and accept.window == WINDOW
    got = 0
    eof = False
    while True:
        chunk = await stream.read()
        if chunk is None:
            break
        assert len(chunk.data) <= agent_streams.CHUNK
        got += len(chunk.data)
        eof = eof or chunk.eof
        # what the agent has sent but the server has not read never exceeds the window
        assert pair.handlers[0].sent - got <= WINDOW
        await pair.settle()
    assert got == 3 * 1024 * 1024 + 7 and eof
    close = await stream.closed()
    assert not close.HasField("error")
    assert len(pair.server) == 0 and len(pair.agent) == 0


async def test_a_consumer_that_stops_stalls_only_its_own_stream() -> None:
    pair = Pair(total=2 * 1024 * 1024)
    stalled = pair.open()
    flowing = pair.open()
    await pair.settle()
    got = 0
    while (chunk := await flowing.read()) is not None:
        got += len(chunk.data)
        await pair.settle()
    assert got == 2 * 1024 * 1024
    # the stalled stream's producer sent exactly one window and waits for credit
    stalled_handler = pair.handlers[0]
    assert stalled_handler.sent == WINDOW
    assert sum(len(c.data) for c in stalled._inbox) == WINDOW
    assert len(pair.agent) == 1  # the stalled one is still open
    got = 0
    while (chunk := await stalled.read()) is not None:
        got += len(chunk.data)
        await pair.settle()
    assert got == 2 * 1024 * 1024


async def test_the_server_never_writes_past_the_agents_credit() -> None:
    pair = Pair()
    stream = pair.open()
    await pair.settle()
    await stream.accepted()
    handler = pair.handlers[0]
    handler.consume = False
    writer = asyncio.create_task(stream.write(0, b"z" * (3 * WINDOW)))
    await pair.settle()
    assert not writer.done()
    assert len(handler.received[0]) == WINDOW  # exactly what the agent granted
    handler.consume = True
    stream_on_agent = handler.stream
    stream_on_agent.consumed(0, WINDOW)  # the agent's consumer catches up
    while not writer.done():
        await pair.settle()
    await writer
    await stream.end(0)
    await pair.settle()
    assert len(handler.received[0]) == 3 * WINDOW and 0 in handler.eof


async def test_refusals_arrive_with_code_and_field() -> None:
    pair = Pair()
    pair.refuse = StreamRefused("bad-cwd", "no such directory", "cwd")
    stream = pair.open()
    await pair.settle()
    with pytest.raises(ServerRefused) as info:
        await stream.accepted()
    assert (info.value.code, info.value.field) == ("bad-cwd", "cwd")
    assert len(pair.server) == 0 and len(pair.agent) == 0


async def test_stream_limits_on_both_sides() -> None:
    pair = Pair(agent_max=1, server_max=2)
    first = pair.open()
    second = pair.open()
    with pytest.raises(TooManyStreams):
        pair.open()
    await pair.settle()
    await first.accepted()
    with pytest.raises(ServerRefused) as info:
        await second.accepted()
    assert info.value.code == "too-many-streams"


async def test_cancel_reaches_the_handler_which_answers_with_its_close() -> None:
    pair = Pair(total=10 * WINDOW)
    stream = pair.open()
    await pair.settle()
    stream.cancel("canceled", "the caller went away")
    await pair.settle()
    handler = pair.handlers[0]
    assert handler.closed_with is not None and handler.closed_with.code == "canceled"
    close = await stream.closed()
    assert close.error.code == "canceled"
    assert len(pair.server) == 0 and len(pair.agent) == 0


async def test_a_peer_over_its_credit_is_cut_off() -> None:
    pair = Pair()
    stream = pair.open()
    await pair.settle()
    await stream.accepted()
    too_much = pb.StreamFrame(
        stream_id=stream.id, data=pb.StreamData(channel=1, data=b"x" * (agent_streams.CHUNK))
    )
    for _ in range(WINDOW // agent_streams.CHUNK):
        pair.server.receive(too_much)  # exactly the window: fine
    pair.server.receive(too_much)  # one frame past it
    with pytest.raises(StreamLost) as info:
        await stream.closed()
    assert info.value.code == "protocol"
    assert pair.server.protocol_errors == 1
    await pair.settle()
    assert pair.handlers[0].closed_with is not None  # the agent was told (a cancel)


async def test_a_lost_link_fails_every_waiter_and_ends_the_agents_streams() -> None:
    pair = Pair()
    stream = pair.open()
    await pair.settle()
    await stream.accepted()
    pair.handlers[0].consume = False
    reader = asyncio.create_task(stream.read())
    writer = asyncio.create_task(stream.write(0, b"z" * (2 * WINDOW)))
    await pair.settle()
    pair.server.close_all("test")
    pair.agent.link_lost()
    assert await reader is None
    with pytest.raises(StreamLost):
        await writer
    with pytest.raises(StreamLost) as info:
        await stream.closed()
    assert info.value.code == "link-lost"
    assert pair.handlers[0].closed_with is not None
    assert pair.handlers[0].closed_with.code == "link-lost"
    with pytest.raises(StreamLost):
        pair.open()


class Opened:
    """Agent-side handler of an agent-opened stream: records how it ended."""

    def __init__(self) -> None:
        self.error: pb.StreamError | None = None

    def on_data(self, channel: int, data: bytes, eof: bool) -> None: ...

    def on_credit(self, channel: int) -> None: ...

    def on_close(self, error: pb.StreamError | None) -> None:
        self.error = error


async def test_agent_opened_streams_are_refused_until_a_kind_is_accepted() -> None:
    pair = Pair()
    handler = Opened()
    own = pair.agent.open(pb.StreamOpen(exec=pb.ExecSpec()), handler)
    assert own.id % 2 == 0
    await pair.settle()
    assert handler.error is not None and handler.error.code == "unsupported"
    assert len(pair.agent) == 0 and len(pair.server) == 0


async def test_one_deadline_ends_the_whole_stream_and_tells_the_agent() -> None:
    """`expire_at`: one timer for the stream, not a timeout per read — a reader waiting for
    more gets None, the result raises `timeout`, and the agent is told to stop."""
    pair = Pair()  # the producer sends nothing: the command is "quiet"
    stream = pair.server.open(ExecSpec(argv=["sleep", "60"]))
    await pair.settle()
    started = await stream.started()
    assert isinstance(started, ExecStarted) and started.pid == 42
    loop = asyncio.get_running_loop()
    stream.expire_at(loop.time() + 0.2, "the agent did not finish the command in time")
    t0 = loop.time()
    assert await stream.read() is None
    assert 0.15 <= loop.time() - t0 < 5
    with pytest.raises(StreamLost) as info:
        await stream.result()
    assert info.value.code == "timeout" and "in time" in info.value.message
    await pair.settle()
    handler = pair.handlers[0]
    assert handler.closed_with is not None and handler.closed_with.code == "canceled"


async def test_a_bulk_stream_grants_its_own_window() -> None:
    pair = Pair()
    big = 4 * WINDOW
    stream = pair.server.open(ExecSpec(argv=["true"]), window=big)
    await pair.settle()
    await stream.accepted()
    agent_side = pair.handlers[0].stream
    assert agent_side.room(1) == big  # the agent may send the larger window before credit
    assert stream.window == big


async def test_frames_larger_than_64_kib_go_only_to_a_peer_that_takes_them() -> None:
    pair = Pair()
    stream = pair.open()
    await pair.settle()
    await stream.accepted()
    agent_side = pair.handlers[0].stream
    # both sides of this version say they take MAX_FRAME: each may send that much per frame
    assert stream.max_frame == server_streams.MAX_FRAME > server_streams.BASE_FRAME
    assert agent_side.max_frame == agent_streams.MAX_FRAME
    sent: list[pb.ServerMessage] = []
    pair.server._send_message = sent.append
    await stream.write(0, b"y" * WINDOW, chunk=10 * 1024 * 1024)  # the agent's whole window
    sizes = []
    while (msg := pair.server.next_message()) is not None:
        sizes.append(len(msg.stream.data.data))
    assert sizes == [WINDOW]  # one frame, larger than 64 KiB
    # a peer that does not say (an older one, max_frame 0) gets 64 KiB frames at most
    legacy = agent_streams.Stream(pair.agent, 99, 1 << 20, 0)
    assert legacy.max_frame == agent_streams.BASE_FRAME
    # and a frame larger than what this side takes is refused, whatever the window
    too_big = pb.StreamFrame(
        stream_id=stream.id,
        data=pb.StreamData(channel=1, data=b"x" * (server_streams.MAX_FRAME + 1)),
    )
    pair.server.receive(too_big)
    with pytest.raises(StreamLost) as info:
        await stream.closed()
    assert info.value.code == "protocol"


class Failing(Producer):
    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        raise OSError(107, "Transport endpoint is not connected")


async def test_a_failing_handler_ends_its_stream_never_the_link() -> None:
    pair = Pair()
    pair.agent.openers["exec"] = lambda s, m: (Failing(s, 0), pb.StreamAccept())
    broken, healthy = pair.open(), pair.open()
    await pair.settle()
    await broken.write(0, b"boom")
    await pair.settle()  # the table's receive must not raise into the link's loop
    close = await broken.closed()
    assert close.error.code == "internal" and "not connected" in close.error.message
    assert healthy.failure is None and not healthy.local_closed
