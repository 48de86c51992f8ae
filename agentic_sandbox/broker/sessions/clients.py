"""A client attached to a session (a browser, sandboxctl, a test) and its writer loop.

There is no per-client copy of the output: each client has an offset into the session's ring
and one writer task that sends frames from the ring at the pace the client's socket accepts.
The hub only wakes writers; it never waits for one. A client further behind than its bound
while it does not take what it was sent (its transport is backed up), or behind the ring's
start, is skipped ahead to a screen snapshot (`resync`) — a burst larger than the bound that
the writer has not sent yet is not the client's lag; after a resync, what came while the
snapshot was sent is caught up as after an attach. A client stuck in
one send for too long is disconnected by the hub's sweep. Control messages for a client go in
a small bounded queue ahead of output; a client that lets it overflow is disconnected too.

The writer sees its session through `StreamSource` only (the ring, where output will end, the
snapshot and the exit message), so this module depends on nothing else of the hub.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.sessions import protocol as proto

if TYPE_CHECKING:
    from prometheus_client import Counter

    from agentic_sandbox.broker.sessions.ring import OutputRing
    from agentic_sandbox.broker.sessions.screen import Snapshot

log = logging.getLogger(__name__)

CONTROL_QUEUE_LIMIT = 256


class ClientTransport(Protocol):
    async def send_text(self, text: str) -> None: ...

    async def send_binary(self, data: bytes) -> None: ...

    async def close(self, code: int, message: str) -> None: ...

    def abort(self) -> None: ...

    def backed_up(self) -> bool:
        """The client has not taken what was sent (bytes wait above the kernel's buffer)."""
        ...


class StreamSource(Protocol):
    """What a client's writer reads of its session (a `HubSession`)."""

    @property
    def ring(self) -> OutputRing: ...

    @property
    def agent_end(self) -> int:
        """Where the agent's output ended at its last registration (output still to come)."""
        ...

    @property
    def synced(self) -> bool:
        """The ring reflects the agent (False after a server restart until it registers)."""
        ...

    @property
    def ended(self) -> bool: ...

    def snapshot(self) -> Snapshot: ...

    def exit_message(self) -> str: ...


class AttachedClient:
    def __init__(
        self,
        session: StreamSource,
        principal: Principal,
        transport: ClientTransport,
        *,
        may_control: bool,
        max_lag: int,
        frame_bytes: int,
        relayed: Counter,
        resyncs: Counter,
    ) -> None:
        self.id = secrets.token_hex(4)
        self.session = session
        self.principal = principal
        self.transport = transport
        self.may_control = may_control  # the caller's right to take the lease, fixed at attach
        self.max_lag = max_lag
        self.frame_bytes = frame_bytes
        self._relayed = relayed
        self._resyncs = resyncs
        self.role: proto.ClientRole = proto.ROLE_OBSERVER
        self.offset = 0
        self.pending_resync: proto.ResyncReason | None = None
        # Output the client asked for (attaching with `from`, or a resume after a restart) is
        # caught up losslessly while the ring holds it; the lag bound applies past this offset.
        self.catchup_until = 0
        self.control: deque[str] = deque()
        self.wake = asyncio.Event()
        self.sending_since: float | None = None
        self.closed = False
        self.exit_sent = False
        self.close_reason = ""
        self.task: asyncio.Task[None] | None = None

    @property
    def subject(self) -> str:
        return self.principal.subject

    def member(self) -> proto.Member:
        return {"id": self.id, "subject": self.principal.subject, "role": self.role}

    def queue(self, text: str) -> None:
        if self.closed:
            return
        if len(self.control) >= CONTROL_QUEUE_LIMIT:
            self.kick("too many unread control messages")
            return
        self.control.append(text)
        self.wake.set()

    def kick(self, reason: str) -> None:
        """Disconnect at once (the client is stuck or misbehaving)."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        try:
            self.transport.abort()
        except Exception:
            log.debug("aborting a client transport failed", exc_info=True)
        if self.task is not None:
            self.task.cancel()

    async def _send(self, op: Awaitable[None]) -> None:
        self.sending_since = asyncio.get_running_loop().time()
        try:
            await op
        finally:
            self.sending_since = None

    async def run(self) -> None:
        """Send control messages and output until the client or the session goes away."""
        sess = self.session
        try:
            while not self.closed:
                self.wake.clear()
                if self.control:
                    await self._send(self.transport.send_text(self.control.popleft()))
                    continue
                ring = sess.ring
                if self.pending_resync is None:
                    if self.offset < ring.end and (
                        self.offset < ring.start
                        or (
                            ring.end - self.offset > self.max_lag
                            and self.offset >= self.catchup_until
                            # behind the ring is not behind: a burst larger than the bound
                            # (one batch from the agent) waits for a client that reads
                            and self.transport.backed_up()
                        )
                    ):
                        self.pending_resync = "behind"
                    elif self.offset > max(ring.end, sess.agent_end) and (
                        sess.synced or sess.ended
                    ):
                        self.pending_resync = "offset-unavailable"
                if self.pending_resync is not None:
                    reason, self.pending_resync = self.pending_resync, None
                    snap = sess.snapshot()
                    self.offset = snap.offset
                    if reason == "behind":
                        self._resyncs.inc()
                    await self._send(
                        self.transport.send_text(
                            proto.resync(
                                reason,
                                offset=snap.offset,
                                cols=snap.cols,
                                rows=snap.rows,
                                screen=snap.ansi,
                            )
                        )
                    )
                    # as after an attach: what came while the snapshot was sent is caught up
                    # losslessly while the ring holds it (a burst larger than the lag bound
                    # meanwhile would otherwise be a second resync before any frame)
                    self.catchup_until = max(self.catchup_until, sess.ring.end)
                    continue
                if ring.start <= self.offset < ring.end:
                    frame = ring.frame(self.offset, self.frame_bytes)
                    n = len(frame) - 8
                    self.offset += n
                    self._relayed.inc(n)
                    await self._send(self.transport.send_binary(frame))
                    continue
                if sess.ended and not self.exit_sent and self.offset >= ring.end:
                    self.exit_sent = True
                    await self._send(self.transport.send_text(sess.exit_message()))
                    await self.transport.close(1000, "session ended")
                    break
                await self.wake.wait()
        except asyncio.CancelledError:
            pass
        except (ConnectionError, RuntimeError, OSError) as exc:
            self.close_reason = self.close_reason or f"send failed: {exc}"
        finally:
            self.closed = True
