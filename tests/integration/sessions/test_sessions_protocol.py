"""The link protocol: an agent speaking one the server does not is refused cleanly, named in
the agent's state, and linking again with a shared protocol clears it."""

from __future__ import annotations

import grpc
import pytest

from agentic_sandbox.proto import PROTOCOL, PROTOCOL_METADATA, PROTOCOLS
from agentic_sandbox.proto import agent_pb2 as pb
from tests.support.agents import register_host_instance
from tests.support.crafted import CraftedAgent
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.sessions import events


async def test_an_agent_of_another_protocol_is_refused_and_named(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    iid = unique_id("proto")
    register_host_instance(server, iid)
    link = await CraftedAgent.enroll(server, iid)
    low, high = PROTOCOLS
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await link.connect(pb.Register(instance_id=iid, protocol=high + 1), timeout=10)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert dict(err.value.trailing_metadata() or ())[PROTOCOL_METADATA] == f"{low}-{high}"
        detail = err.value.details() or ""
        assert f"protocol {high + 1}" in detail and "upgrade the server" in detail
        state = server.ok("GET", f"/api/v2/admin/agents/{iid}")
        assert state["state"] == "incompatible" and f"protocol {high + 1}" in state["problem"]
        refused = events(server, "agent.refused", instance_id=iid)
        assert refused and refused[-1]["data"]["reason"] == "protocol"

        # an agent from before versions sends no protocol (0): protocol 1, which links
        ack = await link.connect(pb.Register(instance_id=iid), timeout=10)
        assert ack.protocol == PROTOCOL
        state = server.ok("GET", f"/api/v2/admin/agents/{iid}")
        assert state["state"] == "connected" and state["problem"] == ""
    finally:
        await link.close()

    # a real agent says which protocol it speaks and links
    agent = agent_factory(server)
    assert server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")["state"] == "connected"
