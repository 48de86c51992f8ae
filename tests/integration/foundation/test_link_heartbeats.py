"""Heartbeat answers on the agent link: the server answers the heartbeats an agent asks to have
answered (`Heartbeat.want_ack`, once its Register says `acks_when_asked`), and every heartbeat of
an agent that does not say so. The real agent asks when it has heard nothing for three and a
half intervals, so an idle link carries a quarter of the answers and still never looks silent.

Answers can be late: a link is dead only when an ask has gone unanswered for three intervals
(at least 5 s), so a slow path back — a starved guest's — keeps its link; a path that answers
nothing still ends it.

A real server subprocess, a real host agent (behind a loopback relay that holds what the server
sends), and a crafted agent for the server's rule. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from agentic_sandbox.proto import agent_pb2 as pb
from tests.support.agents import register_host_instance
from tests.support.crafted import CraftedAgent
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.polling import wait_until
from tests.support.relay import CuttingRelay
from tests.support.sessions import metric

pytestmark = pytest.mark.timeout(120)

MESSAGES = "sandbox_grpc_messages_total"
HEARTBEATS = 'direction="in",kind="heartbeat"'
ANSWERS = 'direction="out",kind="heartbeat_ack"'
REGISTERS = 'direction="in",kind="register"'


def test_an_idle_agent_has_every_fourth_heartbeat_answered_and_keeps_its_link(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()  # heartbeats every 0.5 s: a link silent for 5 s is dead
    agent = agent_factory(server, unique_id("heartbeats"))
    time.sleep(1.0)  # past the first heartbeat (always asked) and the bundle's trial
    counts = [metric(server, MESSAGES, k) for k in (HEARTBEATS, ANSWERS, REGISTERS)]
    time.sleep(6.0)  # longer than the agent's silence limit
    beats, answers, registers = (
        metric(server, MESSAGES, k) - c
        for k, c in zip((HEARTBEATS, ANSWERS, REGISTERS), counts, strict=True)
    )
    assert beats >= 9, beats
    assert 0.15 * beats <= answers <= 0.35 * beats, (beats, answers)
    assert registers == 0  # the agent never took its link for dead
    state = server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")["state"]
    assert state == "connected"


async def _answers_within(link: CraftedAgent, seconds: float) -> int:
    """Heartbeat answers read in the next `seconds` (the read goes on in its own task: a
    cancelled read would cancel the call)."""
    answers = 0

    async def count() -> None:
        nonlocal answers
        while True:
            msg = await link.read()
            answers += msg.WhichOneof("body") == "heartbeat_ack"

    reader = asyncio.create_task(count())
    await asyncio.sleep(seconds)
    assert not reader.done(), reader  # the link is still up
    reader.cancel()
    return answers


@pytest.mark.parametrize("asks", [True, False], ids=["acks-when-asked", "older-agent"])
async def test_the_server_answers_what_the_agent_asked_for(
    server_factory: ServerFactory, asks: bool
) -> None:
    server = server_factory()
    iid = unique_id("crafted-heartbeat")
    register_host_instance(server, iid)
    link = await CraftedAgent.enroll(server, iid)
    try:
        await link.connect(pb.Register(instance_id=iid, acks_when_asked=asks))
        for want in (False, False, False, True):
            await link.send(pb.AgentMessage(heartbeat=pb.Heartbeat(time_unix_ms=1, want_ack=want)))
        answers = await _answers_within(link, 1.0)
        # an agent that asks gets the one it asked for; an older agent, one for each
        assert answers == (1 if asks else 4)
    finally:
        await link.close()


@contextlib.contextmanager
def relay_thread(port: int) -> Iterator[CuttingRelay]:
    """A relay in front of `port` on its own loop and thread (the test's agent calls block)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    relay = asyncio.run_coroutine_threadsafe(CuttingRelay(port).start(), loop).result(5)
    try:
        yield relay
    finally:
        asyncio.run_coroutine_threadsafe(relay.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_late_answer_keeps_the_link_and_no_answer_ends_it(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    """Heartbeats every 0.5 s: the agent asks after 1.75 s of silence, and used to take the link
    for dead after 5 s of it, answered or not. With the server's answers 3.5 s late an ask went
    out 1.75-2.25 s into a silence and its answer came 5.25-5.75 s into it: a live link torn
    down every few seconds. Now the ask has 5 s of its own."""
    server = server_factory()
    with relay_thread(server.grpc_port) as relay:
        agent = agent_factory(
            server, unique_id("late-answers"), extra_args=["--server", f"127.0.0.1:{relay.port}"]
        )
        registers = metric(server, MESSAGES, REGISTERS)
        relay.delay = 3.5
        time.sleep(15.0)  # three of the old silence limits
        assert metric(server, MESSAGES, REGISTERS) == registers, agent.log_text()[-3000:]
        assert "silent" not in agent.log_text()
        state = server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")["state"]
        assert state == "connected"
        # answers that never come end the link: after the silence limit and the ask's own
        # time (5 + at most ~7 s), the agent says so and connects again once the path is back
        relay.delay = 60.0
        wait_until(lambda: "the link was silent for" in agent.log_text(), "link ends", 20)
        line = next(x for x in agent.log_text().splitlines() if "the link was silent for" in x)
        assert "after asking" in line, line
        relay.delay = 0.0
        wait_until(lambda: metric(server, MESSAGES, REGISTERS) > registers, "link back", 30)
