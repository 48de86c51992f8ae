"""One connection of the agent link: register, then send and receive until it ends.

The agent's first message is `register` with its session inventory; the server answers with
where each session's output resumes and which sessions to end. Then three tasks share the
connection: the sender (queued messages first, then session output as each session's flow
allows), heartbeats (a heartbeat asks for an answer when nothing has been heard for three and a
half intervals, and on a new link's first: on an idle link the server answers every fourth
one), and renewal of the certificate on this connection's channel. The reader dispatches what
the server sends.

A link is dead when nothing has been heard for five intervals *and* the first ask since the
server last spoke has gone unanswered for three (at least 5 s): an answer always has that long
to arrive, however late in the silence the ask went out. (Silence alone left an ask between
one and two and a half intervals: a starved guest's answer, a second or two late, took a live
link for dead.) A watchdog task checks it; when its deadline finds no ask out (the loop stalled
past the heartbeat that would have asked), or wakes long after it was due (the agent itself
was stalled), it asks then and waits the answer's time. A restored clone does not wait for
this: its new seed cancels the old link.

`LinkOwner` is what the link needs of the agent (the runtime implements it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Protocol

import grpc

from agentic_sandbox.agent import enrollment
from agentic_sandbox.agent.channels import connect_channel
from agentic_sandbox.agent.config import AgentConfig
from agentic_sandbox.agent.controls import ControlAddress
from agentic_sandbox.agent.credentials import Credentials
from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc
from agentic_sandbox.proto import gather

log = logging.getLogger("agent")

CONNECT_TIMEOUT = 10.0  # to register and hear the server's answer
DEFAULT_HEARTBEAT = 5.0
# A heartbeat asks for an answer after this many silent intervals, so an idle link carries an
# answer every fourth heartbeat; a link silent for SILENCE_INTERVALS is dead, which the gap
# between answers stays under by an interval. (Each answer is a write on the server: at 5000
# links, answering every second heartbeat was about a quarter of its link CPU.)
ASK_AFTER_INTERVALS = 3.5
SILENCE_INTERVALS = 5
ANSWER_INTERVALS = 3  # how long an asked answer may take before the link is dead
STALL_SECONDS = 1.0  # the watchdog woke this much later than due: the agent was stalled


class LinkOwner(Protocol):
    heartbeat_interval: float
    wake_event: asyncio.Event

    def register_message(self) -> pb.Register: ...

    def on_registered(self, ack: pb.RegisterAck) -> None: ...

    def handle(self, msg: pb.ServerMessage) -> None: ...

    def next_message(self, now: float) -> tuple[pb.AgentMessage | None, float | None]: ...

    def queue_heartbeat(self, ask: bool) -> None: ...


class Link:
    def __init__(
        self, owner: LinkOwner, cfg: AgentConfig, creds: Credentials, control: ControlAddress
    ) -> None:
        self.owner = owner
        self.cfg = cfg
        self.creds = creds
        self.control = control
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self.up = False
        self.batches = False  # the server takes batches (its RegisterAck said so)
        self.connect_seconds = 0.0  # channel, handshake and registration of the last connect
        self.channel_seconds = 0.0  # of which the channel (and the forward's sync)
        self.heard_at = 0.0  # loop time of the server's last message on this connection
        self.asked_at: float | None = None  # loop time of the first ask since then
        self._dead = ""  # why the watchdog ended this connection ("": it did not)

    def silence_limit(self) -> float:
        """A link that says nothing for this long is dead (a heartbeat asks for an answer after
        `ask_after()` of silence)."""
        return max(SILENCE_INTERVALS * self.owner.heartbeat_interval, 5.0)

    def ask_after(self) -> float:
        """A heartbeat asks for an answer when the server has been silent this long."""
        return ASK_AFTER_INTERVALS * self.owner.heartbeat_interval

    def answer_limit(self) -> float:
        """An ask unanswered for this long (with the silence limit passed) is a dead link."""
        return max(ANSWER_INTERVALS * self.owner.heartbeat_interval, 5.0)

    def dead_at(self) -> float:
        """Loop time at which the link is dead if nothing is heard before."""
        silent = self.heard_at + self.silence_limit()
        return silent if self.asked_at is None else max(silent, self.asked_at + self.answer_limit())

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    async def run(self, on_up: Any = None) -> None:
        """Connect, register, and serve the connection until it ends (returns on a clean end,
        raises on a failure)."""
        started = time.monotonic()
        channel = self.channel = await connect_channel(self.cfg, self.creds, "link", self.control)
        self.channel_seconds = time.monotonic() - started
        tasks: list[asyncio.Task[None]] = []
        try:
            call = self.call = pb_grpc.AgentLinkStub(channel).Connect()
            register = pb.AgentMessage(register=self.owner.register_message())
            # asyncio.timeout, not wait_for: on 3.11 a wait_for whose read completes as the
            # task is cancelled swallows the cancel (an agent stopped mid-flood kept running)
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await call.write(register)
                first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("body") != "register_ack":
                raise ConnectionError("the server did not acknowledge the registration")
            self.batches = first.register_ack.batches
            self.heard_at = asyncio.get_running_loop().time()
            self.owner.on_registered(first.register_ack)
            self.connect_seconds = time.monotonic() - started
            self.up = True
            if on_up is not None:
                on_up(self)
            self._dead = ""
            tasks = [
                asyncio.create_task(self._sender(call), name="agent-sender"),
                asyncio.create_task(self._heartbeats(), name="agent-heartbeats"),
                asyncio.create_task(self._renewals(), name="agent-renewal"),
                asyncio.create_task(self._watchdog(call), name="agent-watchdog"),
            ]
            loop = asyncio.get_running_loop()
            try:
                while True:
                    msg = await call.read()
                    self.heard_at = loop.time()
                    self.asked_at = None
                    if msg is grpc.aio.EOF:
                        return
                    if msg.WhichOneof("body") == "batch":
                        self._handle_batch(msg.batch)
                    else:
                        self.owner.handle(msg)
                    for t in tasks:
                        if t.done() and not t.cancelled():
                            t.result()  # surface a failed sender
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                me = asyncio.current_task()
                if self._dead and (me is None or not me.cancelling()):
                    raise ConnectionError(self._dead) from None  # the watchdog cancelled it
                raise
        finally:
            self.up = False
            self.call = None
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.channel = None
            await channel.close()

    def _handle_batch(self, batch: pb.ServerBatch) -> None:
        if not self.batches:
            raise ConnectionError("the server sent a batch, which this link did not agree to")
        for msg in batch.messages:
            if msg.WhichOneof("body") == "batch":
                raise ConnectionError("the server sent a batch inside a batch")
            self.owner.handle(msg)

    async def _sender(self, call: Any) -> None:
        loop = asyncio.get_running_loop()
        wake = self.owner.wake_event
        while True:
            wake.clear()
            now = loop.time()
            msg, wait = self.owner.next_message(now)
            if msg is not None:
                await call.write(self._gather(msg, now) if self.batches else msg)
                continue
            if wait is not None:
                timer = loop.call_later(wait, wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
            else:
                await wake.wait()
            if self.batches:
                # once more round the loop first: callbacks already due (an exec's exit after
                # its last output) queue theirs, and the burst goes in one write
                await asyncio.sleep(0)

    def _gather(self, first: pb.AgentMessage, now: float) -> pb.AgentMessage:
        """`first` and what else is ready, as one batch when there is more."""
        return gather(
            first,
            lambda: self.owner.next_message(now)[0],
            lambda ready: pb.AgentMessage(batch=pb.AgentBatch(messages=ready)),
        )

    async def _watchdog(self, call: Any) -> None:
        """End the connection when it is dead (`dead_at`). A deadline reached is a check, not a
        verdict: with no ask out yet (the loop stalled past the heartbeat that would have
        asked) the ask goes now and has its full time; a wake-up much later than due means the
        agent itself was stalled, which says nothing of the server, and its ask starts again."""
        loop = asyncio.get_running_loop()
        while True:
            due = self.dead_at()
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            if now < self.dead_at():
                continue  # heard from, or asked, since
            if self.asked_at is None or now - due > STALL_SECONDS:
                self.asked_at = now
                self.owner.queue_heartbeat(True)
                self.owner.wake_event.set()
                continue
            self._dead = (
                f"the link was silent for {now - self.heard_at:.1f}s, "
                f"{now - self.asked_at:.1f}s after asking"
            )
            call.cancel()
            return

    async def _heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        ask = True  # the first: a restored guest steps its clock at once
        while True:
            self.owner.queue_heartbeat(ask)
            if ask and self.asked_at is None:
                # the answer's time starts now: the link is not dead before it has passed
                self.asked_at = loop.time()
            await asyncio.sleep(self.owner.heartbeat_interval)
            ask = loop.time() - self.heard_at >= self.ask_after()

    async def _renewals(self) -> None:
        """Renew on this connection's channel when a third of the certificate's life is left
        (a guest's forward carries one connection: renewal never opens another)."""
        while True:
            now = time.time()
            due = self.creds.renew_due()
            if now >= due:
                try:
                    await enrollment.renew(self.cfg, self.creds, self.control, self.channel)
                    continue
                except Exception as exc:
                    log.warning("certificate renewal failed: %s", exc)
                    await asyncio.sleep(30.0)
                    continue
            await asyncio.sleep(min(60.0, max(0.5, due - now)))
