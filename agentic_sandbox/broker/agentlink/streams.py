"""Byte streams on the server's side of an agent link: the table on each `AgentConnection`.

The protocol (`StreamFrame` in `proto/agent.proto`, the agent's side in `agent/streams.py`):
streams multiplexed on the link's one `Connect` stream, opened by either side (server ids odd,
agent ids even), numbered channels each with its own credit-based flow control and
half-close, and one close per side carrying a typed result or an error.

What the rest of the server uses (exec, files, ports), with the typed
values of `stream_kinds.py` (no protobuf outside this package):

    stream = conn.streams.open(ExecSpec(argv=[...]))        # TooManyStreams, LinkClosed
    info = await stream.started()                           # StreamRefused / StreamLost
    await stream.write(0, data); stream.end(0)              # waits for the agent's credit
    async for chunk in stream:                              # Chunk(channel, data, eof);
        ...                                                 # credit goes back as you take them
    result = await stream.result()                          # the agent's close: typed result
    stream.cancel("canceled", "the caller went away")       # any time; idempotent
    stream.expire_at(deadline)                              # one deadline for the whole stream

Agent-opened streams (egress) are handed, with their typed spec (`stream_kinds.opened`), to an
acceptor registered by kind (`LinkStreams.acceptors`, bound per link from
`AgentRegistry.stream_acceptors`); an unregistered kind is told `unsupported`. The acceptor
answers with `accept(stream, spec)` and ends with `finish(stream, result)`.

Bounds: at most `max_streams` per link (`TooManyStreams`); what the agent may send a stream
is what the stream granted (`window` per channel, credited back a quarter at a time as the
consumer reads), so one stream buffers at most its window per channel; what the server
writes waits for credit (so a stream queues at most what the agent granted it). Data frames
are at most 64 KiB (`BASE_FRAME`) unless the other side's open or accept says it takes
larger ones (`max_frame`, up to `MAX_FRAME`: bulk transfers send fewer, larger frames). A
frame over its credit, over `MAX_FRAME`, or for a channel out of range ends that stream
(`protocol`) — the agent is not trusted. Outgoing data is not in the connection's outbox:
`outgoing()` sends the outbox first (session input, control) and then one stream frame at a
time, round robin, so keystrokes never queue behind more than one bulk stream frame. A link
that closes fails every stream at once (`StreamLost`): nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

from agentic_sandbox.broker.agentlink.stream_kinds import (
    EgressOpened,
    EgressResult,
    OpenSpec,
    Result,
    Started,
    accept_info,
    close_result,
    opened,
    to_accept,
    to_close,
    to_open,
)
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

WINDOW = 256 * 1024
CHUNK = 32 * 1024
BASE_FRAME = 64 * 1024  # what every peer takes (one that does not say its `max_frame`)
MAX_FRAME = 1024 * 1024  # what we take (our `max_frame`); a larger data frame is a protocol error
MAX_WINDOW = 16 * 1024 * 1024
MAX_CHANNEL = 15
CANCEL_REAP_SECONDS = 30.0  # a cancelled stream the agent never closes is forgotten after this


class StreamError(Exception):
    """A stream ended without its result: `code`, `message` and the spec `field` if any."""

    def __init__(self, code: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class StreamRefused(StreamError):
    """The agent did not open the stream (bad spec, limits, unsupported kind)."""


class StreamLost(StreamError):
    """The link ended (or the stream was cut off) before the stream did."""


class TooManyStreams(Exception):
    pass


class Chunk(NamedTuple):
    channel: int
    data: bytes
    eof: bool


Acceptor = Callable[["ServerStream", EgressOpened], Awaitable[None]]


class ServerStream:
    """One stream on a link, as its user sees it."""

    def __init__(
        self,
        table: LinkStreams,
        stream_id: int,
        peer_window: int,
        window: int = 0,
        peer_max_frame: int = 0,
    ) -> None:
        self.id = stream_id
        self._table = table
        self.window = window or table.window  # what we grant per channel before any credit
        self._loop = asyncio.get_running_loop()
        self._peer_window = peer_window
        self.max_frame = BASE_FRAME  # the largest data frame the agent takes
        self._set_max_frame(peer_max_frame)
        self._credit: dict[int, int] = {}
        self._credit_event = asyncio.Event()
        self._allowance: dict[int, int] = {}
        self._owed: dict[int, int] = {}
        self._inbox: deque[Chunk] = deque()
        self._inbox_event = asyncio.Event()
        self._outq: deque[pb.StreamFrame] = deque()
        self._out_free = asyncio.Event()
        self._out_free.set()
        self._accept: asyncio.Future[pb.StreamAccept] = self._loop.create_future()
        self._close: asyncio.Future[pb.StreamClose] = self._loop.create_future()
        self.local_closed = False  # we sent our close (or cancel)
        self.failure: StreamError | None = None
        self._accept.add_done_callback(_consume)
        self._close.add_done_callback(_consume)
        self._deadline: asyncio.TimerHandle | None = None

    # ---- opening ---------------------------------------------------------------------------
    async def accepted(self) -> pb.StreamAccept:
        return await asyncio.shield(self._accept)

    async def started(self) -> Started:
        """The agent's accept, as its kind's typed info (`StreamRefused`, `StreamLost`)."""
        return accept_info(await self.accepted())

    # ---- the deadline ------------------------------------------------------------------------
    def expire_at(self, when: float | None, message: str = "the stream ran out of time") -> None:
        """At loop time `when` (None: never), the stream fails with `StreamLost("timeout")`
        — every wait on it ends — and the agent is told to stop: one timer for the whole
        stream rather than a timeout on each read."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if when is not None:
            self._deadline = self._loop.call_at(when, self._expire, message)

    def _expire(self, message: str) -> None:
        self._deadline = None
        if self._close.done() and not self._inbox:
            return
        self._fail(StreamLost("timeout", message))
        self.cancel("canceled", message)

    def _set_max_frame(self, peer_max_frame: int) -> None:
        self.max_frame = min(max(peer_max_frame, BASE_FRAME), MAX_FRAME)

    # ---- sending ---------------------------------------------------------------------------
    def room(self, channel: int) -> int:
        return self._credit.get(channel, self._peer_window)

    async def write(self, channel: int, data: bytes, *, chunk: int = CHUNK) -> None:
        """Send `data` on `channel` as the agent's credit allows, in frames of `chunk` bytes
        (at most the agent's `max_frame`: bulk transfers use fewer, larger frames). Frames
        within the credit are queued at once (the credit bounds what a stream queues); the
        link's writer takes one frame per stream in turn."""
        chunk = min(chunk, self.max_frame)
        view = memoryview(data)
        while view:
            self._raise_if_done()
            room = self.room(channel)
            if room <= 0:
                self._credit_event.clear()
                await self._wait(self._credit_event)
                continue
            n = min(room, chunk, len(view))
            self._credit[channel] = room - n
            part = data if n == len(data) else bytes(view[:n])
            self._outq.append(
                pb.StreamFrame(stream_id=self.id, data=pb.StreamData(channel=channel, data=part))
            )
            self._table._ready(self)
            view = view[n:]

    async def end(self, channel: int) -> None:
        """Half-close `channel`: nothing more will be written on it."""
        self._raise_if_done()
        await self._queue(
            pb.StreamFrame(stream_id=self.id, data=pb.StreamData(channel=channel, eof=True))
        )

    async def _queue(self, frame: pb.StreamFrame) -> None:
        while self._outq:
            self._out_free.clear()
            await self._wait(self._out_free)
            self._raise_if_done()
        self._outq.append(frame)
        self._table._ready(self)

    async def _wait(self, event: asyncio.Event) -> None:
        """Wait for `event`, or for the stream to end (whichever first)."""
        if self._close.done() or self.failure is not None:
            return
        waiter: asyncio.Future[object] = asyncio.ensure_future(event.wait())
        closing: asyncio.Future[object] = self._close  # type: ignore[assignment]
        try:
            await asyncio.wait({waiter, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    def _raise_if_done(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._close.done() or self.local_closed:
            raise StreamLost("closed", "the stream is closed")

    # ---- receiving -------------------------------------------------------------------------
    async def read(self) -> Chunk | None:
        """The next chunk the agent sent (any channel), or None once the agent closed the
        stream and everything before its close was read."""
        while not self._inbox:
            if self._close.done() or self.failure is not None:
                return None
            self._inbox_event.clear()
            await self._wait(self._inbox_event)
        chunk = self._inbox.popleft()
        self._consumed(chunk.channel, len(chunk.data))
        return chunk

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        while True:
            chunk = await self.read()
            if chunk is None:
                return
            yield chunk

    def _consumed(self, channel: int, n: int) -> None:
        if n <= 0 or self.local_closed or self._close.done():
            return
        owed = self._owed.get(channel, 0) + n
        if owed >= self.window // 4:
            self._owed[channel] = 0
            self._allowance[channel] = self._allowance.get(channel, self.window) + owed
            self._table._send(
                pb.StreamFrame(
                    stream_id=self.id, credit=pb.StreamCredit(channel=channel, bytes=owed)
                )
            )
        else:
            self._owed[channel] = owed

    async def closed(self) -> pb.StreamClose:
        """The agent's close; raises `StreamLost` when the link (or the stream) failed."""
        return await asyncio.shield(self._close)

    async def result(self) -> Result:
        """The agent's close as its kind's typed result; a close with an error (or without
        a result) raises `StreamError` with the agent's code, message and field."""
        close = await self.closed()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        out = close_result(close)
        if close.HasField("error") or out is None:
            err = close.error
            raise StreamError(err.code or "agent-error", err.message or "no result", err.field)
        return out

    # ---- ending ------------------------------------------------------------------------------
    def cancel(self, code: str = "canceled", message: str = "cancelled by the server") -> None:
        """Close our side with an error (the agent stops and answers with its close)."""
        if self.local_closed:
            return
        self.local_closed = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._outq.clear()
        self._out_free.set()
        self._table._send(
            pb.StreamFrame(
                stream_id=self.id,
                close=pb.StreamClose(error=pb.StreamError(code=code, message=message)),
            )
        )
        self._table._cancelled(self)

    def _fail(self, error: StreamError) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.failure is None:
            self.failure = error
        for fut in (self._accept, self._close):
            if not fut.done():
                fut.set_exception(error)
        self._credit_event.set()
        self._inbox_event.set()
        self._out_free.set()

    # ---- frames from the agent (called by the table) ----------------------------------------
    def _on_frame(self, body: str, frame: pb.StreamFrame) -> str:
        """Apply a frame; returns a protocol problem, or ""."""
        if body == "accept":
            if self._accept.done():
                return "a second accept"
            self._peer_window = min(max(frame.accept.window, 0), MAX_WINDOW)
            self._set_max_frame(frame.accept.max_frame)
            self._accept.set_result(frame.accept)
            self._credit_event.set()
        elif body == "data":
            msg = frame.data
            ch, n = msg.channel, len(msg.data)
            if not self._accept.done():
                return "data before the accept"
            if ch > MAX_CHANNEL:
                return f"channel {ch} out of range"
            if n > MAX_FRAME:
                return f"a data frame of {n} bytes (at most {MAX_FRAME})"
            left = self._allowance.get(ch, self.window)
            if n > left:
                return f"{n} bytes on channel {ch} with {left} granted"
            self._allowance[ch] = left - n
            if not self.local_closed:
                self._inbox.append(Chunk(ch, bytes(msg.data), msg.eof))
                self._inbox_event.set()
        elif body == "credit":
            ch = frame.credit.channel
            if ch <= MAX_CHANNEL:
                self._credit[ch] = min(MAX_WINDOW, self.room(ch) + frame.credit.bytes)
                self._credit_event.set()
        elif body == "close":
            close = frame.close
            if not self._accept.done():
                err = close.error
                self._fail(
                    StreamRefused(
                        err.code or "refused", err.message or "refused by the agent", err.field
                    )
                )
                return ""
            if not self._close.done():
                self._close.set_result(close)
            self._credit_event.set()
            self._inbox_event.set()
            self._out_free.set()
        return ""

    def _take_frame(self) -> pb.StreamFrame | None:
        if not self._outq:
            return None
        frame = self._outq.popleft()
        self._out_free.set()
        return frame


def _consume(fut: asyncio.Future[pb.StreamAccept] | asyncio.Future[pb.StreamClose]) -> None:
    """Mark a stream future's exception retrieved (no 'never retrieved' noise)."""
    if not fut.cancelled():
        fut.exception()


class LinkStreams:
    """The streams of one agent link."""

    def __init__(
        self,
        send: Callable[[pb.ServerMessage], None],
        wake: Callable[[], None],
        *,
        max_streams: int = 128,
        window: int = WINDOW,
    ) -> None:
        self._send_message = send
        self._wake = wake
        self.max_streams = max_streams
        self.window = window
        self._streams: dict[int, ServerStream] = {}
        self._pending: deque[ServerStream] = deque()
        self._next_id = 1
        self._closed: StreamLost | None = None
        self.acceptors: dict[str, Acceptor] = {}
        self.protocol_errors = 0
        self._reapers: dict[int, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._streams)

    # ---- opening ---------------------------------------------------------------------------
    def open(self, spec: OpenSpec | pb.StreamOpen, *, window: int = 0) -> ServerStream:
        """Open a stream on the agent (its kind and spec: a typed spec of `stream_kinds`);
        `window`: what it accepts per channel before credit (default the link's; a bulk
        transfer asks for more, up to `MAX_WINDOW`)."""
        msg = spec if isinstance(spec, pb.StreamOpen) else to_open(spec)
        if self._closed is not None:
            raise self._closed
        if len(self._streams) >= self.max_streams:
            raise TooManyStreams(f"this agent link has {len(self._streams)} streams (the limit)")
        sid = self._next_id
        self._next_id += 2
        stream = ServerStream(self, sid, 0, min(window, MAX_WINDOW))
        self._streams[sid] = stream
        msg.window = stream.window
        msg.max_frame = MAX_FRAME
        try:
            self._send_message(pb.ServerMessage(stream=pb.StreamFrame(stream_id=sid, open=msg)))
        except Exception:
            del self._streams[sid]
            raise
        return stream

    # ---- outgoing ----------------------------------------------------------------------------
    def _send(self, frame: pb.StreamFrame) -> None:
        """Send a control frame (credit, cancel, …). A link that is closing fails every stream
        through `close_all` anyway: its refusal here is not the caller's error."""
        if self._closed is not None:
            return
        try:
            self._send_message(pb.ServerMessage(stream=frame))
        except Exception as exc:  # LinkClosed (link.py imports this module)
            log.debug("stream frame not sent: %s", exc)

    def _ready(self, stream: ServerStream) -> None:
        if stream not in self._pending:
            self._pending.append(stream)
        self._wake()

    def next_message(self) -> pb.ServerMessage | None:
        """One queued data frame of the next stream in turn (for the connection's writer)."""
        while self._pending:
            stream = self._pending.popleft()
            frame = stream._take_frame()
            if frame is None:
                continue
            if stream._outq:
                self._pending.append(stream)
            return pb.ServerMessage(stream=frame)
        return None

    # ---- incoming ----------------------------------------------------------------------------
    def receive(self, frame: pb.StreamFrame) -> None:
        sid = frame.stream_id
        body = frame.WhichOneof("body") or ""
        if body == "open":
            self._on_open(sid, frame.open)
            return
        stream = self._streams.get(sid)
        if stream is None:
            return  # ended here already (a late credit or data after a cancel)
        problem = stream._on_frame(body, frame)
        if problem:
            self.protocol_errors += 1
            log.warning("agent stream %d: %s; ending it", sid, problem)
            stream._fail(StreamLost("protocol", f"the agent broke the stream protocol: {problem}"))
            stream.cancel("protocol", problem)
            return
        if body == "close":
            self._forget(sid)

    def _on_open(self, sid: int, msg: pb.StreamOpen) -> None:
        def refuse(code: str, message: str) -> None:
            self._send(
                pb.StreamFrame(
                    stream_id=sid,
                    close=pb.StreamClose(error=pb.StreamError(code=code, message=message)),
                )
            )

        if sid == 0 or sid % 2 == 1 or sid in self._streams:
            self.protocol_errors += 1
            return
        kind = msg.WhichOneof("kind") or ""
        acceptor = self.acceptors.get(kind)
        spec = opened(msg)
        if acceptor is None or spec is None:
            refuse("unsupported", f"the server accepts no {kind or '?'} streams from agents")
            return
        if len(self._streams) >= self.max_streams:
            refuse("too-many-streams", f"at most {self.max_streams} streams per link")
            return
        stream = ServerStream(
            self, sid, min(max(msg.window, 0), MAX_WINDOW), peer_max_frame=msg.max_frame
        )
        stream._accept.set_result(pb.StreamAccept(window=self.window))
        self._streams[sid] = stream
        task = asyncio.ensure_future(acceptor(stream, spec))
        task.add_done_callback(lambda t: self._acceptor_done(stream, t))

    def _acceptor_done(self, stream: ServerStream, task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("agent stream %d failed: %s", stream.id, task.exception())
            stream.cancel("internal", "the server failed to serve the stream")

    def accept(self, stream: ServerStream, spec: EgressOpened) -> None:
        """Tell the agent an agent-opened stream is accepted (acceptors call this first)."""
        accept = to_accept(spec)
        accept.window = self.window
        accept.max_frame = MAX_FRAME
        self._send(pb.StreamFrame(stream_id=stream.id, accept=accept))

    def finish(self, stream: ServerStream, result: EgressResult) -> None:
        """Our close with a result (for agent-opened streams)."""
        if stream.local_closed:
            return
        stream.local_closed = True
        self._send(pb.StreamFrame(stream_id=stream.id, close=to_close(result)))
        if stream._close.done():
            self._forget(stream.id)

    def _cancelled(self, stream: ServerStream) -> None:
        if stream._close.done() or stream.failure is not None:
            self._forget(stream.id)
            return
        # the agent answers a cancel with its close; one that never does is forgotten
        self._reapers[stream.id] = asyncio.get_running_loop().call_later(
            CANCEL_REAP_SECONDS, self._reap, stream.id
        )

    def _reap(self, sid: int) -> None:
        self._reapers.pop(sid, None)
        stream = self._streams.pop(sid, None)
        if stream is not None:
            stream._fail(StreamLost("timeout", "the agent never closed the cancelled stream"))

    def _forget(self, sid: int) -> None:
        self._streams.pop(sid, None)
        timer = self._reapers.pop(sid, None)
        if timer is not None:
            timer.cancel()

    def close_all(self, reason: str) -> None:
        """The link is gone: every stream fails now."""
        if self._closed is None:
            self._closed = StreamLost("link-lost", f"the agent link was lost: {reason}")
        streams = list(self._streams.values())
        self._streams.clear()
        self._pending.clear()
        for timer in self._reapers.values():
            timer.cancel()
        self._reapers.clear()
        for stream in streams:
            with contextlib.suppress(Exception):
                stream._fail(self._closed)
