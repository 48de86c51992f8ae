"""The agent link's messages as the rest of the server sees them: plain typed values.

Protobuf stops at the agent link's edge. What an agent reports about its sessions reaches the
session layer (the `LinkHandler`) as these values, converted here from the `agent_pb2`
messages; what the server asks of an agent goes out through `AgentConnection`'s typed
commands (`open_session`, `send_input`, …), which build the protobuf messages themselves.

The values are mechanical copies: nothing is checked here. Everything an agent sends stays
untrusted (ids, offsets, sizes, strings); the session layer decides what it accepts.
They are plain (not frozen) slotted dataclasses: `Output` is built once per output message on
the hot path, and a frozen dataclass costs about three times as much to build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agentic_sandbox.broker.agentlink.stream_kinds import BudgetSpec, FileInfo
from agentic_sandbox.proto import agent_pb2 as pb

SignalName = Literal["INT", "TERM", "KILL", "HUP"]
SIGNAL_NAMES: tuple[SignalName, ...] = ("INT", "TERM", "KILL", "HUP")


# ---- agent -> server ---------------------------------------------------------------------------
@dataclass(slots=True)
class ExitReport:
    """How a session's process ended, as the agent tells it."""

    code: int | None  # None: no exit code (killed by a signal, or never started)
    signal: str = ""  # "INT", "TERM", "KILL", "HUP", … ("" when not killed by a signal)
    error: str = ""  # the process could not be started, or was lost
    reason: str = ""  # the budget that ended it: timeout, memory, pids, output-limit ("" none)
    cpu_us: int = 0  # what the session used
    peak_memory_bytes: int = 0
    output_bytes: int = 0
    enforcement: str = ""  # how its budget was enforced: cgroup-v2, cgroup-v1, none
    # `OpenRequest.list_on_exit` as the process left it (None: not listed — not asked, an
    # older agent, or the agent could not; then a file stream lists it)
    listing: list[FileInfo] | None = None

    @classmethod
    def from_pb(cls, info: pb.ExitInfo) -> ExitReport:
        return cls(
            code=info.code if info.has_code else None,
            signal=info.signal,
            error=info.error,
            reason=info.reason,
            cpu_us=info.cpu_us,
            peak_memory_bytes=info.peak_memory_bytes,
            output_bytes=info.output_bytes,
            enforcement=info.enforcement,
        )


@dataclass(slots=True)
class Opened:
    """The agent's answer to `open_session`."""

    session_id: str
    ok: bool
    error: str = ""
    pid: int = 0

    @classmethod
    def from_pb(cls, msg: pb.SessionOpened) -> Opened:
        return cls(session_id=msg.session_id, ok=msg.ok, error=msg.error, pid=msg.pid)


@dataclass(slots=True)
class Output:
    """Output of a session: `data` starts at stream offset `offset`."""

    session_id: str
    offset: int
    data: bytes


@dataclass(slots=True)
class Exited:
    """A session ended; every output byte below `end_offset` has been sent before this."""

    session_id: str
    end_offset: int
    exit: ExitReport

    @classmethod
    def from_pb(cls, msg: pb.SessionExit) -> Exited:
        report = ExitReport.from_pb(msg.exit)
        if msg.HasField("listing"):
            report.listing = [FileInfo.from_pb(e) for e in msg.listing.entries]
        return cls(msg.session_id, msg.end_offset, report)


@dataclass(slots=True)
class Inventory:
    """One session the agent holds, as it reports it when it (re)registers."""

    session_id: str
    running: bool  # False: it has exited (the agent still holds its output)
    ring_start: int  # oldest output offset the agent still holds
    end_offset: int  # total output bytes so far
    cols: int = 0  # 0: not known
    rows: int = 0
    pid: int = 0
    task_id: str = ""

    @classmethod
    def from_pb(cls, item: pb.SessionInventory) -> Inventory:
        return cls(
            session_id=item.session_id,
            running=item.state == pb.SESSION_STATE_RUNNING,
            ring_start=item.ring_start,
            end_offset=item.end_offset,
            cols=item.cols,
            rows=item.rows,
            pid=item.pid,
            task_id=item.task_id,
        )


def inventory_from_pb(register: pb.Register) -> list[Inventory]:
    return [Inventory.from_pb(item) for item in register.sessions]


# ---- server -> agent ---------------------------------------------------------------------------
@dataclass(slots=True)
class OpenRequest:
    """What `open_session` asks the agent to start."""

    session_id: str
    command: Sequence[str] = ()  # empty: the user's login shell
    cols: int = 80
    rows: int = 24
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    user: str = ""
    task_id: str = ""
    budget: BudgetSpec | None = None  # None: no budget (no cgroup of its own)
    make_dirs: Sequence[str] = ()  # made by the agent before the command starts
    list_on_exit: str = ""  # listed by the agent into the exit (`ExitReport.listing`)


@dataclass(slots=True)
class Resume:
    """In a registration answer: keep this session; its output resumes at `from_offset`."""

    session_id: str
    from_offset: int


@dataclass(slots=True)
class Reconciled:
    """The session layer's answer to a registration."""

    resume: list[Resume] = field(default_factory=list)  # sessions to keep
    close: list[str] = field(default_factory=list)  # sessions to end (or forget, if exited)
