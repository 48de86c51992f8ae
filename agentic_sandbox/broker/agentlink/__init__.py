"""The agent link: the server's CA, enrollment, the gRPC service and the registry of agents.

Public face: `AgentLinkComponent` (wired in `broker/components.py`); `AgentConnection` (one
agent's link and its typed commands), `LinkClosed`; `AgentRegistry` (the connected agents,
which the hub is handed); `LinkHandler` (what the session hub implements) and the typed
values it receives and answers with (`messages.py`); the byte streams multiplexed on a link
(`ServerStream` and its `Chunk`s and errors, `streams.py`) that exec, files and ports ride on,
opened with the typed specs of `stream_kinds.py` and answering with its typed results.
The server's CA (`CertificateAuthority`) also issues the libvirt TLS identities of
``qemu+tls`` hosts (`broker/instances/host_credentials.py`). Protobuf stays in this package.
"""

from agentic_sandbox.broker.agentlink.ca import CertificateAuthority, CertificateError
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
from agentic_sandbox.broker.agentlink.stream_kinds import (
    DIGEST,
    KIND_NAMES,
    AgentBundleResult,
    AgentBundleSpec,
    BudgetSpec,
    EgressOpened,
    EgressResult,
    EgressTrust,
    EgressTrustResult,
    ExecResult,
    ExecSpec,
    ExecStarted,
    FileDownload,
    FileInfo,
    FileList,
    FileListing,
    FileMkdir,
    FileRemove,
    FileRemoved,
    FileResult,
    FileStat,
    FileUpload,
    PortConnected,
    PortResult,
    PortSpec,
)
from agentic_sandbox.broker.agentlink.streams import (
    Chunk,
    ServerStream,
    StreamError,
    StreamLost,
    TooManyStreams,
)

__all__ = [
    "DIGEST",
    "KIND_NAMES",
    "SIGNAL_NAMES",
    "AgentBundleResult",
    "AgentBundleSpec",
    "AgentConnection",
    "AgentLinkComponent",
    "AgentRegistry",
    "BudgetSpec",
    "CertificateAuthority",
    "CertificateError",
    "Chunk",
    "EgressOpened",
    "EgressResult",
    "EgressTrust",
    "EgressTrustResult",
    "ExecResult",
    "ExecSpec",
    "ExecStarted",
    "ExitReport",
    "Exited",
    "FileDownload",
    "FileInfo",
    "FileList",
    "FileListing",
    "FileMkdir",
    "FileRemove",
    "FileRemoved",
    "FileResult",
    "FileStat",
    "FileUpload",
    "Inventory",
    "LinkClosed",
    "LinkHandler",
    "OpenRequest",
    "Opened",
    "Output",
    "PortConnected",
    "PortResult",
    "PortSpec",
    "Reconciled",
    "Resume",
    "ServerStream",
    "SignalName",
    "StreamError",
    "StreamLost",
    "TooManyStreams",
]
