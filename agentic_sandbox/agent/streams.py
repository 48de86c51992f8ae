"""Byte streams on the agent's side of the link: the stream table and per-stream flow control.

A stream is a typed, bidirectional byte pipe multiplexed on the one `Connect` stream the
sessions use (a guest's forward carries one connection at a time: there is no second one).
Either side opens streams: the server opens `exec`, `file_*` and `port`, the agent opens
`egress` streams. Ids are the opener's: odd for the server's, even
for the agent's (`open()` here), never reused on a link.

- **Channels**: numbered byte channels per stream (exec: 0 = stdin, 1 = stdout, 2 = stderr),
  each half-closed on its own (`StreamData.eof`).
- **Flow control**: per stream and channel, credit-based. The opener's `StreamOpen.window` and
  the accepter's `StreamAccept.window` are what each accepts on every channel it receives
  before any credit; a receiver returns credit (`StreamCredit`) as its consumer takes the
  bytes, batched a quarter window at a time. A sender never sends more than it was granted
  (a peer that does is cut off: `protocol`), so a slow consumer stalls only its own stream,
  and what one stream buffers is bounded by its windows.
- **Bounded**: at most `max_streams` streams at once (then `too-many-streams`); a data frame
  carries at most `CHUNK` bytes, or up to the peer's `max_frame` for bulk transfers (files):
  each side's open or accept says the largest frame it takes (`MAX_FRAME` here; 0 from an
  older peer: `BASE_FRAME`), and a frame larger than ours is refused.
- **Close**: each side ends with one `StreamClose`, carrying its kind's typed result or an
  error; the agent's close goes after every data frame of that stream. A close from the server
  cancels (the handler ends its work and answers with its own close).
- **Fairness**: the runtime's `next_message()` sends control first (the outbox, then stream
  control: accepts and credits), then session output, then stream data — one chunk at a time,
  round robin across streams, and a stream chunk after every bulk session message, so an
  interactive session's echo never waits behind more than one stream chunk and a flooding
  session cannot starve streams.
- **Link loss**: a link that drops ends every stream at once (`link_lost`: the handlers stop
  their work and clean up; nothing is sent); the server fails its side the same way.

A kind plugs in with an `Opener` (validate the open, start the work, return the handler and
the accept info) registered by name (`StreamOpen.kind`'s field name: "exec").
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

WINDOW = 256 * 1024  # what this side accepts per channel before any credit
CHUNK = 32 * 1024  # at most this much data per frame (one frame never hogs the link)
BASE_FRAME = 64 * 1024  # what every peer takes (one that does not say its `max_frame`)
MAX_FRAME = 1024 * 1024  # what we take (our `max_frame`); a larger data frame is a protocol error
MAX_WINDOW = 16 * 1024 * 1024  # a peer's window or credit is capped here
MAX_CHANNEL = 15


class StreamRefused(Exception):
    """An open that cannot be served: the close's error (code, message, field)."""

    def __init__(self, code: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def error(self) -> pb.StreamError:
        return pb.StreamError(code=self.code, message=self.message, field=self.field)


class StreamHandler(Protocol):
    """What a stream kind does with what arrives (the exec run implements it)."""

    def on_data(self, channel: int, data: bytes, eof: bool) -> None: ...

    def on_credit(self, channel: int) -> None: ...

    def on_close(self, error: pb.StreamError | None) -> None:
        """The peer closed the stream (a cancel) or the link was lost (`link-lost`)."""
        ...


class Inert:
    """The handler of a stream whose work is done at its open (nothing more arrives, a cancel
    stops nothing): an egress CA written, a bundle the agent runs already."""

    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        return None

    def on_credit(self, channel: int) -> None:
        return None

    def on_close(self, error: pb.StreamError | None) -> None:
        return None


#: an opener validates the open and starts the work; it answers with the handler and the accept,
#: or with None for the accept when it comes later (a port's connect): the handler then calls
#: `Stream.accept` once it can serve, or `Stream.fail` (a close before any accept: a refusal)
Opener = Callable[["Stream", pb.StreamOpen], tuple[StreamHandler, pb.StreamAccept | None]]


class Stream:
    """One stream: credit in both directions and what waits to be sent, in order."""

    def __init__(
        self, table: StreamTable, stream_id: int, peer_window: int, peer_max_frame: int = 0
    ) -> None:
        self.id = stream_id
        self._table = table
        self._peer_window = min(max(peer_window, 0), MAX_WINDOW)
        self.max_frame = BASE_FRAME  # the largest data frame the peer takes
        self._set_max_frame(peer_max_frame)
        # what we grant per channel before any credit; an opener may raise it (up to
        # MAX_WINDOW) for a bulk transfer before the accept goes out
        self.window = table.window
        self._credit: dict[int, int] = {}  # bytes we may still send, per channel
        self._allowance: dict[int, int] = {}  # bytes the peer may still send us, per channel
        self._owed: dict[int, int] = {}  # consumed bytes not yet credited back
        self._control: deque[pb.StreamFrame] = deque()
        self._data: deque[pb.StreamFrame] = deque()
        self._final: pb.StreamClose | None = None
        self.handler: StreamHandler | None = None
        self.detached = False  # the link is gone or our close was sent: nothing more goes out
        self.remote_closed = False
        self.accepted = stream_id % 2 == 1  # the server's streams are accepted by opening them

    def _set_max_frame(self, peer_max_frame: int) -> None:
        self.max_frame = min(max(peer_max_frame, BASE_FRAME), MAX_FRAME)

    # ---- sending -----------------------------------------------------------------------------
    def room(self, channel: int) -> int:
        """How many bytes may be sent on `channel` now."""
        return self._credit.get(channel, self._peer_window)

    def send(self, channel: int, data: bytes, eof: bool = False) -> None:
        """Queue data (within `room(channel)`; the caller reads only that much) and/or the
        channel's end."""
        if self.detached or self._final is not None:
            return
        n = len(data)
        room = self.room(channel)
        if n > room:
            raise ValueError(f"stream {self.id}: {n} bytes exceed the credit of {room}")
        self._credit[channel] = room - n
        self._data.append(
            pb.StreamFrame(
                stream_id=self.id, data=pb.StreamData(channel=channel, data=data, eof=eof)
            )
        )
        self._table.ready_data(self)

    def finish(self, close: pb.StreamClose) -> None:
        """End the stream: the close goes after every queued data frame."""
        if self.detached or self._final is not None:
            return
        self._final = close
        self._table.ready_data(self)

    def fail(self, code: str, message: str, field: str = "") -> None:
        self.finish(pb.StreamClose(error=pb.StreamError(code=code, message=message, field=field)))

    def accept(self, accept: pb.StreamAccept) -> None:
        """Send a deferred accept (an opener that answered None): ahead of anything else."""
        if self.detached or self._final is not None or self.remote_closed:
            return
        accept.window = self.window
        accept.max_frame = MAX_FRAME
        self._control.appendleft(pb.StreamFrame(stream_id=self.id, accept=accept))
        self._table.ready_control(self)

    # ---- receiving ---------------------------------------------------------------------------
    def consumed(self, channel: int, n: int) -> None:
        """The handler took `n` received bytes of `channel`: credit them back, batched."""
        if self.detached or n <= 0:
            return
        owed = self._owed.get(channel, 0) + n
        if owed >= self.window // 4:
            self._owed[channel] = 0
            self._allowance[channel] = self._allowance.get(channel, self.window) + owed
            self._control.append(
                pb.StreamFrame(
                    stream_id=self.id, credit=pb.StreamCredit(channel=channel, bytes=owed)
                )
            )
            self._table.ready_control(self)
        else:
            self._owed[channel] = owed

    def _on_data(self, msg: pb.StreamData) -> str:
        """A data frame from the peer; returns a protocol problem, or ""."""
        ch = msg.channel
        n = len(msg.data)
        if ch > MAX_CHANNEL:
            return f"channel {ch} out of range"
        if n > MAX_FRAME:
            return f"a data frame of {n} bytes (at most {MAX_FRAME})"
        left = self._allowance.get(ch, self.window)
        if n > left:
            return f"{n} bytes on channel {ch} with {left} granted"
        self._allowance[ch] = left - n
        if self.handler is not None and not self.remote_closed:
            try:
                self.handler.on_data(ch, bytes(msg.data), msg.eof)
            except Exception as exc:  # a kind's failure ends its stream, never the link
                log.exception("stream %d: its handler failed", self.id)
                self.fail("internal", f"{type(exc).__name__}: {exc}")
        return ""

    def _on_credit(self, msg: pb.StreamCredit) -> None:
        ch = msg.channel
        if ch > MAX_CHANNEL:
            return
        self._credit[ch] = min(MAX_WINDOW, self.room(ch) + msg.bytes)
        if self.handler is not None and not self.remote_closed:
            try:
                self.handler.on_credit(ch)
            except Exception as exc:
                log.exception("stream %d: its handler failed", self.id)
                self.fail("internal", f"{type(exc).__name__}: {exc}")

    # ---- the table's side --------------------------------------------------------------------
    def _next_control(self) -> pb.StreamFrame | None:
        return self._control.popleft() if self._control else None

    def _next_data(self) -> pb.StreamFrame | None:
        if self._data:
            return self._data.popleft()
        if self._final is not None and not self.detached:
            self.detached = True
            return pb.StreamFrame(stream_id=self.id, close=self._final)
        return None

    @property
    def has_data(self) -> bool:
        return bool(self._data) or (self._final is not None and not self.detached)


class StreamTable:
    """The streams of one agent: opened by the server (by kind) or by the agent."""

    def __init__(
        self,
        openers: dict[str, Opener],
        *,
        wake: Callable[[], None],
        max_streams: int = 64,
        window: int = WINDOW,
    ) -> None:
        self.openers = openers
        self.max_streams = max_streams
        self.window = window
        self._wake = wake
        self._streams: dict[int, Stream] = {}
        self._control_ready: deque[Stream] = deque()
        self._data_ready: deque[Stream] = deque()
        self._next_own_id = 2
        self._refusals: deque[pb.StreamFrame] = deque()  # closes for opens never admitted
        self.protocol_errors = 0

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def kinds(self) -> list[str]:
        return sorted(self.openers)

    # ---- scheduling --------------------------------------------------------------------------
    def ready_control(self, stream: Stream) -> None:
        if stream not in self._control_ready:
            self._control_ready.append(stream)
        self._wake()

    def ready_data(self, stream: Stream) -> None:
        if stream not in self._data_ready:
            self._data_ready.append(stream)
        self._wake()

    def next_control(self) -> pb.AgentMessage | None:
        """Accepts, credits and refusals: small, and ahead of all data."""
        if self._refusals:
            return pb.AgentMessage(stream=self._refusals.popleft())
        while self._control_ready:
            stream = self._control_ready[0]
            frame = stream._next_control()
            if frame is None:
                self._control_ready.popleft()
                continue
            if not stream._control:
                self._control_ready.popleft()
            return pb.AgentMessage(stream=frame)
        return None

    def next_data(self) -> pb.AgentMessage | None:
        """One data frame (or a final close) of the next stream in turn."""
        while self._data_ready:
            stream = self._data_ready.popleft()
            frame = stream._next_data()
            if frame is None:
                continue
            if stream.has_data:
                self._data_ready.append(stream)
            if frame.WhichOneof("body") == "close":
                self._streams.pop(stream.id, None)
            return pb.AgentMessage(stream=frame)
        return None

    @property
    def has_data(self) -> bool:
        return bool(self._data_ready)

    # ---- opening -----------------------------------------------------------------------------
    def _refuse(self, stream_id: int, code: str, message: str, field: str = "") -> None:
        if len(self._refusals) >= 4 * self.max_streams:
            return  # a peer flooding opens gets no more answers than this
        self._refusals.append(
            pb.StreamFrame(
                stream_id=stream_id,
                close=pb.StreamClose(error=pb.StreamError(code=code, message=message, field=field)),
            )
        )
        self._wake()

    def _on_open(self, stream_id: int, msg: pb.StreamOpen) -> None:
        if stream_id % 2 == 0 or stream_id in self._streams:
            self.protocol_errors += 1
            log.warning("the server opened stream %d, which is not a new server id", stream_id)
            return
        kind = msg.WhichOneof("kind") or ""
        opener = self.openers.get(kind)
        if opener is None:
            self._refuse(stream_id, "unsupported", f"this agent has no {kind or '?'} streams")
            return
        if len(self._streams) >= self.max_streams:
            self._refuse(
                stream_id,
                "too-many-streams",
                f"this agent serves at most {self.max_streams} streams at once",
            )
            return
        stream = Stream(self, stream_id, msg.window, msg.max_frame)
        self._streams[stream_id] = stream
        try:
            handler, accept = opener(stream, msg)
        except StreamRefused as exc:
            del self._streams[stream_id]
            self._refuse(stream_id, exc.code, exc.message, exc.field)
            return
        except Exception as exc:
            del self._streams[stream_id]
            log.exception("opening a %s stream failed", kind)
            self._refuse(stream_id, "internal", f"{type(exc).__name__}: {exc}")
            return
        stream.handler = handler
        if accept is not None:
            stream.accept(accept)

    def open(self, msg: pb.StreamOpen, handler: StreamHandler) -> Stream:
        """Open a stream of our own (egress): the server answers with accept or close."""
        if len(self._streams) >= self.max_streams:
            raise StreamRefused("too-many-streams", f"at most {self.max_streams} streams at once")
        stream_id = self._next_own_id
        self._next_own_id += 2
        stream = Stream(self, stream_id, 0)  # nothing may be sent before the accept's window
        stream.handler = handler
        self._streams[stream_id] = stream
        msg.window = self.window
        msg.max_frame = MAX_FRAME
        stream._control.append(pb.StreamFrame(stream_id=stream_id, open=msg))
        self.ready_control(stream)
        return stream

    # ---- what arrives ------------------------------------------------------------------------
    def receive(self, frame: pb.StreamFrame) -> None:
        sid = frame.stream_id
        body = frame.WhichOneof("body")
        if body == "open":
            self._on_open(sid, frame.open)
            return
        stream = self._streams.get(sid)
        if stream is None:
            return  # a stream that ended here already (late credit, a crossing close)
        if body == "data":
            problem = stream._on_data(frame.data)
            if problem:
                self.protocol_errors += 1
                log.warning("stream %d: %s; ending it", sid, problem)
                self._cancel(stream, pb.StreamError(code="protocol", message=problem))
                stream.fail("protocol", problem)
        elif body == "credit":
            stream._on_credit(frame.credit)
        elif body == "accept":
            if sid % 2 == 1:
                self.protocol_errors += 1
                return
            stream._peer_window = min(max(frame.accept.window, 0), MAX_WINDOW)
            stream._set_max_frame(frame.accept.max_frame)
            stream.accepted = True
            if stream.handler is not None:
                try:
                    stream.handler.on_credit(0)  # the accept's window: the opener may send now
                except Exception as exc:
                    log.exception("stream %d: its handler failed", sid)
                    stream.fail("internal", f"{type(exc).__name__}: {exc}")
        elif body == "close":
            error = frame.close.error if frame.close.HasField("error") else None
            if not stream.accepted:  # our open was refused: there is nothing to close
                stream.detached = True
                self._streams.pop(sid, None)
            self._cancel(stream, error)

    def _cancel(self, stream: Stream, error: pb.StreamError | None) -> None:
        if stream.remote_closed:
            return
        stream.remote_closed = True
        handler = stream.handler
        if handler is not None:
            try:
                handler.on_close(error)
            except Exception:
                log.exception("stream %d: ending it failed", stream.id)
        if stream.detached:  # our close went already: nothing more to wait for
            self._streams.pop(stream.id, None)

    def link_lost(self) -> None:
        """The link dropped: every stream ends here and now (its handler cleans up)."""
        streams = list(self._streams.values())
        self._streams.clear()
        self._control_ready.clear()
        self._data_ready.clear()
        self._refusals.clear()
        self._next_own_id = 2
        lost = pb.StreamError(code="link-lost", message="the link to the server was lost")
        for stream in streams:
            stream.detached = True
            if stream.handler is not None and not stream.remote_closed:
                stream.remote_closed = True
                try:
                    stream.handler.on_close(lost)
                except Exception:
                    log.exception("stream %d: ending it failed", stream.id)
