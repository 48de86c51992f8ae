"""Heartbeat answers on the agent link: the server answers the heartbeats an agent asks to have
answered (`Heartbeat.want_ack`, once its Register says `acks_when_asked`), and every heartbeat of
an agent that does not say so. The real agent asks when it has heard nothing for three and a
half intervals, so an idle link carries a quarter of the answers and still never looks silent.

A real server subprocess, a real host agent, and a crafted agent for the server's rule.
Loopback only.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from agentic_sandbox.proto import agent_pb2 as pb
from tests.support.agents import register_host_instance
from tests.support.crafted import CraftedAgent
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
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
