"""Batches on the agent link (`AgentBatch`, `ServerBatch`): a burst of ready messages goes in
one gRPC write, only between peers that both said they take batches.

A real server subprocess; a real host agent (exec output floods and short commands: what the
batches are for), and a crafted agent with a valid certificate for what a peer may and may not
send. Loopback only.
"""

from __future__ import annotations

import pytest

from agentic_sandbox.proto import agent_pb2 as pb
from tests.integration.exec.helpers import ok
from tests.support.agents import register_host_instance
from tests.support.crafted import CraftedAgent
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.sessions import metric

pytestmark = pytest.mark.timeout(240)

MESSAGES = "sandbox_grpc_messages_total"


def _flat(msg: pb.ServerMessage) -> list[pb.ServerMessage]:
    return list(msg.batch.messages) if msg.WhichOneof("body") == "batch" else [msg]


async def _heartbeat_acks(link: CraftedAgent, want: int) -> list[pb.ServerMessage]:
    """Read until `want` heartbeat answers came; every message read, batches included."""
    seen: list[pb.ServerMessage] = []
    acks = 0
    while acks < want:
        msg = await link.read()
        seen.append(msg)
        acks += sum(m.WhichOneof("body") == "heartbeat_ack" for m in _flat(msg))
    return seen


def test_an_exec_flood_and_short_commands_travel_in_batches_and_lose_nothing(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    agent = agent_factory(server, unique_id("batches"))
    before = metric(server, MESSAGES, 'direction="in",kind="batch"')
    # a flood: frames are read faster than one write completes, so several go in one write
    size = 8 * 1024 * 1024
    line = b"0123456789abcdef\n"
    out = ok(
        server,
        agent.instance_id,
        {"argv": ["sh", "-c", f"yes {line.decode().strip()} | head -c {size}"]},
    )
    assert out["exit_code"] == 0 and out["stdout"]["bytes"] == size, out
    kept = out["stdout"]["data"].encode()
    assert kept and kept == (line * (len(kept) // len(line) + 1))[: len(kept)]  # in order
    flood_batches = metric(server, MESSAGES, 'direction="in",kind="batch"') - before
    assert flood_batches > 0
    # short commands: each answers exactly, batched or not (its output, then its result)
    for i in range(20):
        text = f"line-{i}"
        out = ok(server, agent.instance_id, {"argv": ["sh", "-c", f"echo {text}; echo e >&2"]})
        assert out["stdout"]["data"] == text + "\n" and out["stderr"]["data"] == "e\n", out
    # every message in a batch counts under its own kind too: the stream frames are there
    assert metric(server, MESSAGES, 'direction="in",kind="stream"') > flood_batches


async def test_batches_only_between_peers_that_said_so(server_factory: ServerFactory) -> None:
    server = server_factory()
    iid = unique_id("crafted-batch")
    register_host_instance(server, iid)
    link = await CraftedAgent.enroll(server, iid)
    hb = pb.AgentMessage(heartbeat=pb.Heartbeat(time_unix_ms=1))
    batch = pb.AgentMessage(batch=pb.AgentBatch(messages=[hb, hb, hb]))
    unexpected = 'direction="in",kind="unknown"'
    try:
        # an agent that does not say it takes batches (an older one) is never sent one, and a
        # batch from it is refused as an unknown message: its heartbeats go unanswered
        ack = await link.connect(pb.Register(instance_id=iid))
        assert not ack.batches
        before = metric(server, MESSAGES, unexpected)
        await link.send(batch)
        await link.send(hb)
        seen = await _heartbeat_acks(link, 1)  # answers come in order: the batch's first
        assert all(m.WhichOneof("body") != "batch" for m in seen)
        assert sum(m.WhichOneof("body") == "heartbeat_ack" for m in seen) == 1
        assert metric(server, MESSAGES, unexpected) == before + 1

        # one that says so: every message of its batch is handled, in order
        ack = await link.connect(pb.Register(instance_id=iid, batches=True))
        assert ack.batches
        await link.send(batch)
        await _heartbeat_acks(link, 3)
        # a batch inside a batch is refused (as unknown), the rest of the outer one handled
        nested = pb.AgentMessage(batch=pb.AgentBatch(messages=[batch, hb]))
        before = metric(server, MESSAGES, unexpected)
        await link.send(nested)
        await link.send(hb)
        seen = await _heartbeat_acks(link, 2)
        assert sum(m.WhichOneof("body") == "heartbeat_ack" for x in seen for m in _flat(x)) == 2
        assert metric(server, MESSAGES, unexpected) == before + 1
        assert server.ok("GET", "/readyz") is not None
    finally:
        await link.close()
