"""What the rest of the server may ask of the session layer.

The session hub (`broker/sessions/hub.py`) implements `SessionService`; the task layer (A2A,
v1 tasks) and the admin API use only this contract, never the hub's insides. A task run is a
session like any other: it is attachable live, recorded, and survives a server restart (after a
restart, `follow_output(session_id, from_offset)` continues from the caller's last offset).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from agentic_sandbox.broker.agentlink import BudgetSpec, FileInfo

MAX_EXIT_LISTING = 128  # the agent lists at most this many (proto: `SessionExit.listing`)


class SessionError(Exception):
    """Base of the errors the session layer raises to its callers."""


class AgentUnavailable(SessionError):
    """The instance has no connected (ready) agent right now."""


class SessionNotFound(SessionError):
    pass


class SessionEnded(SessionError):
    """The session has exited; it takes no more input or signals."""


@dataclass(frozen=True)
class SessionSpec:
    instance_id: str
    owner: str
    command: list[str] | None = None  # None: the user's login shell
    cols: int = 80
    rows: int = 24
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None  # None: the agent's default user
    name: str = ""
    task_id: str | None = None  # set when the session is a task's run
    # enforced by the agent in the session's own cgroup (None: no budget, no cgroup)
    budget: BudgetSpec | None = None
    # made by the agent before the command starts (only for an agent that says it does:
    # `AgentInfo.session_dirs`; an older one ignores them)
    make_dirs: tuple[str, ...] = ()
    # a directory the agent lists into the exit (`ExitStatus.listing`) when the process has
    # ended: a task's outbox (an older agent ignores it: its exit has no listing)
    list_on_exit: str = ""


@dataclass(frozen=True)
class BudgetSupport:
    enforcement: str  # cgroup-v2, cgroup-v1, none ("" from an agent that predates budgets)
    budgets: tuple[str, ...]  # the fields it enforces (timeout, output_bytes, memory, …)
    problem: str  # why it cannot enforce the others


@dataclass(frozen=True)
class OutputChunk:
    offset: int  # byte offset of data[0] in the session's output stream
    data: bytes


@dataclass(frozen=True)
class ExitStatus:
    code: int | None  # exit code, None when killed by a signal or lost
    signal: str | None = None  # e.g. "TERM", "KILL"
    lost: bool = False  # the session vanished (agent lost it, or its ring no longer covers)
    reason: str = ""
    exceeded: str = ""  # the budget that ended it: timeout, memory, pids, output-limit
    usage: RunUsage | None = None  # what it used, as its agent measured it (None: not known)
    # `SessionSpec.list_on_exit` as the process left it, at most `MAX_EXIT_LISTING` entries,
    # untrusted as every agent report (None: not listed; ask the files path)
    listing: tuple[FileInfo, ...] | None = None


@dataclass(frozen=True)
class RunUsage:
    cpu_us: int
    peak_memory_bytes: int
    output_bytes: int
    enforcement: str  # how its budget was enforced: cgroup-v2, cgroup-v1, none

    def view(self) -> dict[str, object]:
        """As `session.*` and `task.*` events, task metadata and answers carry it."""
        return {
            "cpu_seconds": self.cpu_us / 1e6,
            "peak_memory_bytes": self.peak_memory_bytes,
            "output_bytes": self.output_bytes,
            "enforcement": self.enforcement,
        }


@dataclass(frozen=True)
class Prompt:
    """A prompt in a session's output that waits for a person (HITL)."""

    session_id: str
    text: str  # the prompt line, ANSI stripped
    offset: int  # output offset just after the prompt


PromptListener = Callable[[Prompt], None]


class SessionService(Protocol):
    def agent_ready(self, instance_id: str) -> bool:
        """True when the instance's agent is connected and registered."""
        ...

    def budget_support(self, instance_id: str) -> BudgetSupport | None:
        """What the instance's connected agent can enforce (None: no agent connected)."""
        ...

    async def create(self, spec: SessionSpec, *, actor: str) -> str:
        """Open a PTY session on the instance's agent; returns the session id.

        Raises AgentUnavailable when the agent is not connected.
        """
        ...

    async def write(self, session_id: str, data: bytes, *, actor: str) -> None:
        """Write input as the server itself (e.g. a task's HITL answer), not as a client."""
        ...

    async def signal(self, session_id: str, signal: str, *, actor: str) -> None:
        """Send INT, TERM, KILL or HUP to the session's process group."""
        ...

    async def kill(self, session_id: str, *, actor: str) -> None: ...

    def follow_output(self, session_id: str, from_offset: int = 0) -> AsyncIterator[OutputChunk]:
        """Output from `from_offset` on, live, until the session ends (then the iterator stops).

        Lossless while the server's ring still holds `from_offset`; raises SessionNotFound for
        an unknown session.
        """
        ...

    async def wait_exit(self, session_id: str) -> ExitStatus: ...

    def add_prompt_listener(self, listener: PromptListener) -> None:
        """Called (on the loop, must not block) for every HITL prompt detected."""
        ...
