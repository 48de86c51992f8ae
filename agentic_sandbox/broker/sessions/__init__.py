"""PTY sessions: the hub, the attach WebSocket, recordings (see contract.py).

Public face: the contract (`SessionService`, `SessionSpec`, `OutputChunk`, `ExitStatus`,
`Prompt` and the errors) and `SessionsComponent` (wired in `broker/components.py`).
"""

from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    ExitStatus,
    OutputChunk,
    Prompt,
    PromptListener,
    SessionEnded,
    SessionError,
    SessionNotFound,
    SessionService,
    SessionSpec,
)

__all__ = [
    "AgentUnavailable",
    "ExitStatus",
    "OutputChunk",
    "Prompt",
    "PromptListener",
    "SessionEnded",
    "SessionError",
    "SessionNotFound",
    "SessionService",
    "SessionSpec",
]
