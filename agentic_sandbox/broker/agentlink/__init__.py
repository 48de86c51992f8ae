"""The agent link: the server's CA, enrollment, the gRPC service and the registry of agents.

Public face: `AgentLinkComponent` (wired in `broker/components.py`); `AgentConnection` (one
agent's link and its typed commands), `LinkClosed`; `AgentRegistry` (the connected agents,
which the hub is handed); `LinkHandler` (what the session hub implements) and the typed
values it receives and answers with (`messages.py`): protobuf never leaves this package.
"""

from agentic_sandbox.broker.agentlink.component import AgentLinkComponent
from agentic_sandbox.broker.agentlink.link import AgentConnection, LinkClosed, LinkHandler
from agentic_sandbox.broker.agentlink.messages import (
    SIGNAL_NAMES,
    Exited,
    ExitReport,
    Inventory,
    Opened,
    OpenRequest,
    Output,
    Reconciled,
    Resume,
    SignalName,
)
from agentic_sandbox.broker.agentlink.registry import AgentRegistry

__all__ = [
    "SIGNAL_NAMES",
    "AgentConnection",
    "AgentLinkComponent",
    "AgentRegistry",
    "ExitReport",
    "Exited",
    "Inventory",
    "LinkClosed",
    "LinkHandler",
    "OpenRequest",
    "Opened",
    "Output",
    "Reconciled",
    "Resume",
    "SignalName",
]
