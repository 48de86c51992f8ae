"""The agent link: the server's CA, enrollment, the gRPC service and the registry of agents.

Public face: `AgentLinkComponent` (wired in `broker/components.py`), `AgentConnection` and
`LinkHandler` (what the session hub implements), `LinkClosed`, and `AgentRegistry` (the
connected agents, which the hub is handed).
"""

from agentic_sandbox.broker.agentlink.component import AgentLinkComponent
from agentic_sandbox.broker.agentlink.link import AgentConnection, LinkClosed, LinkHandler
from agentic_sandbox.broker.agentlink.registry import AgentRegistry

__all__ = ["AgentConnection", "AgentLinkComponent", "AgentRegistry", "LinkClosed", "LinkHandler"]
