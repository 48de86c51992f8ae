"""The agent link: the server's CA, enrollment, the gRPC service and the registry of agents.

Public face: `AgentLinkComponent` (wired in `broker/components.py`); `AgentConnection` (one
agent's link and its typed commands), `LinkClosed`; `AgentRegistry` (the connected agents,
which the hub is handed); `LinkHandler` (what the session hub implements) and the typed
values it receives and answers with (`messages.py`); the byte streams multiplexed on a link
(`ServerStream` and its `Chunk`s and errors, `streams.py`) that exec rides on. Protobuf stays
in this package, but for the `StreamOpen`/`StreamClose` messages exec still builds and reads
(a known limit: typed stream opens would end it).
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
from agentic_sandbox.broker.agentlink.streams import (
    Chunk,
    ServerStream,
    StreamError,
    StreamLost,
    TooManyStreams,
)

__all__ = [
    "SIGNAL_NAMES",
    "AgentConnection",
    "AgentLinkComponent",
    "AgentRegistry",
    "Chunk",
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
    "ServerStream",
    "SignalName",
    "StreamError",
    "StreamLost",
    "TooManyStreams",
]
