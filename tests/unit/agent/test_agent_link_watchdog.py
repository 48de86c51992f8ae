"""The agent link's watchdog (`Link._watchdog`): a link is dead when nothing was heard for the
silence limit and an ask has gone unanswered for its own time. A deadline reached with no ask
out — the loop stalled past the heartbeat that would have asked — asks then instead of ending
a live link; so does a wake-up long after it was due (the agent itself stalled). With
heartbeats every second both limits are 5 s (their floor)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentic_sandbox.agent.link import Link
from agentic_sandbox.proto import agent_pb2 as pb


class Owner:
    heartbeat_interval = 1.0

    def __init__(self) -> None:
        self.wake_event = asyncio.Event()
        self.asks = 0

    def queue_heartbeat(self, ask: bool) -> None:
        self.asks += ask

    def register_message(self) -> pb.Register:
        return pb.Register()

    def on_registered(self, ack: pb.RegisterAck) -> None: ...

    def handle(self, msg: pb.ServerMessage) -> None: ...

    def next_message(self, now: float) -> tuple[pb.AgentMessage | None, float | None]:
        return None, None


class Call:
    def __init__(self) -> None:
        self.cancelled_at: float | None = None

    def cancel(self) -> None:
        self.cancelled_at = asyncio.get_running_loop().time()


async def test_a_stall_past_the_limit_asks_instead_of_ending_the_link() -> None:
    owner = Owner()
    link = Link(owner, None, None, None)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    call: Any = Call()
    link.heard_at = loop.time()
    watchdog = asyncio.create_task(link._watchdog(call))
    await asyncio.sleep(0.1)
    time.sleep(5.5)  # the loop stalls past the 5 s silence limit, no ask went out
    await asyncio.sleep(0.2)
    assert call.cancelled_at is None and owner.asks == 1 and link.asked_at is not None
    asked = link.asked_at
    await asyncio.sleep(3.0)  # an answer within the ask's 5 s keeps the link
    link.heard_at, link.asked_at = loop.time(), None
    await asyncio.sleep(2.5)
    assert call.cancelled_at is None
    # then silence: asked at the limit (5 s), dead 5 s after the ask, not before
    heard = link.heard_at
    await asyncio.wait_for(watchdog, 15)
    assert call.cancelled_at is not None and link.asked_at is not None
    assert link.asked_at - heard >= 4.9 and call.cancelled_at - link.asked_at >= 4.9
    assert link.asked_at > asked and "after asking" in link._dead, link._dead
