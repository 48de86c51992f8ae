"""A session as the hub holds it: its identity, its state, its output and who is attached.

`HubSession` owns what is read from it: the screen snapshot a client resyncs to, the exit
message, the members list. What changes it lives in the modules named for the change
(`output.py` appends, `lifecycle.py` moves its state, `control.py` attaches and arbitrates,
`reconcile.py` resumes it after a (re)registration).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentic_sandbox.broker.agentlink import Opened
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.clients import AttachedClient
from agentic_sandbox.broker.sessions.contract import ExitStatus
from agentic_sandbox.broker.sessions.recording import Recording
from agentic_sandbox.broker.sessions.redaction import StreamRedactor
from agentic_sandbox.broker.sessions.ring import OutputRing
from agentic_sandbox.broker.sessions.screen import ScreenTracker, Snapshot
from agentic_sandbox.broker.sessions.states import ENDED, SessionState
from agentic_sandbox.broker.store import models as m

if TYPE_CHECKING:
    from agentic_sandbox.broker.observability.events import EventBus

log = logging.getLogger(__name__)


class Follower:
    """One `follow_output` iterator: woken when output arrives or the session ends."""

    __slots__ = ("wake",)

    def __init__(self) -> None:
        self.wake = asyncio.Event()


@dataclass(eq=False)
class HubSession:
    id: str
    instance_id: str
    owner: str
    name: str
    command: list[str] | None
    cols: int
    rows: int
    created_at: dt.datetime
    ring: OutputRing
    incarnation: str | None = None  # the instance incarnation the session belongs to
    task_id: str | None = None
    cwd: str | None = None
    user: str | None = None
    lists_on_exit: bool = False  # it asked the agent for an exit listing (only then kept)
    state: SessionState = SessionState.starting
    synced: bool = True  # the ring reflects the agent (False after a restart until it registers)
    recv_end: int = 0  # agent offset of the next byte expected (ring.end + redactor hold)
    agent_end: int = 0  # the agent's output end at its last registration (output to come)
    redactor: StreamRedactor = field(default_factory=StreamRedactor)
    screen: ScreenTracker | None = None
    recording: Recording | None = None
    clients: dict[str, AttachedClient] = field(default_factory=dict)
    controller: AttachedClient | None = None
    followers: set[Follower] = field(default_factory=set)
    exit: ExitStatus | None = None
    exit_waiters: list[asyncio.Future[ExitStatus]] = field(default_factory=list)
    opening: asyncio.Future[Opened] | None = None
    kill_requested: bool = False
    persisted_offset: int = 0
    last_output: float = 0.0
    quiet_timer: asyncio.TimerHandle | None = None
    prompt_checked: int = -1
    ended_mono: float | None = None
    ended_at: dt.datetime | None = None
    recording_path: str | None = None

    @classmethod
    def from_row(cls, row: m.Session, ring_bytes: int) -> HubSession:
        """The session of a stored row (its output continues at the row's offset; its
        recording, if any, is the caller's to resume)."""
        return cls(
            id=row.id,
            instance_id=row.instance_id,
            owner=row.owner,
            name=row.name,
            command=list(row.command) if row.command else None,
            cols=row.cols,
            rows=row.rows,
            created_at=row.created_at,
            ring=OutputRing(ring_bytes, base=row.output_offset),
            incarnation=row.incarnation,
            task_id=row.task_id,
            cwd=row.cwd,
            user=row.user,
            state=SessionState(row.state),
            recv_end=row.output_offset,
            persisted_offset=row.output_offset,
            kill_requested=row.state == SessionState.killing,
            recording_path=row.recording_path,
        )

    @property
    def ended(self) -> bool:
        return self.state in ENDED  # (not state.ended: this is read on every output message)

    def notify(self) -> None:
        """Wake every client writer and follower (new output, or the end)."""
        for client in self.clients.values():
            client.wake.set()
        for follower in self.followers:
            follower.wake.set()

    def members(self) -> list[proto.Member]:
        return [c.member() for c in self.clients.values()]

    def observers(self) -> int:
        return sum(1 for c in self.clients.values() if c.role == proto.ROLE_OBSERVER)

    def current_screen(self) -> ScreenTracker:
        """The screen, caught up with the ring (made on first use: pyte is never on the output
        path)."""
        if self.screen is None:
            self.screen = ScreenTracker(self.cols, self.rows)
        self.screen.catch_up(self.ring)
        return self.screen

    def snapshot(self) -> Snapshot:
        """The screen as ANSI that repaints it, and the offset output continues at."""
        if self.screen is None:
            self.screen = ScreenTracker(self.cols, self.rows)
        return self.screen.snapshot(self.ring)

    def exit_message(self) -> str:
        ex = self.exit or ExitStatus(code=None, lost=True)
        return proto.exit_(
            code=ex.code, signal=ex.signal, lost=ex.lost, reason=ex.reason, offset=self.ring.end
        )

    def flush_recording(self) -> None:
        """Write the recording's buffer out (a failure, e.g. a full disk, is logged)."""
        if self.recording is not None:
            try:
                self.recording.flush()
            except OSError:
                log.exception("flushing recording of %s failed", self.id)

    def close_recording(self) -> None:
        """Close the recording (a failure is logged; closing again tries again)."""
        if self.recording is not None:
            try:
                self.recording.close()
            except OSError:
                log.exception("closing recording of %s failed", self.id)

    def set_size(self, cols: int, rows: int) -> None:
        """The PTY has this size from now on (the screen and the recording follow)."""
        self.cols, self.rows = cols, rows
        if self.screen is not None:
            self.screen.catch_up(self.ring)
            self.screen.resize(cols, rows)
        if self.recording is not None:
            self.recording.resize(cols, rows)


def publish(
    events: EventBus,
    sess: HubSession,
    type_: str,
    *,
    actor: str,
    data: dict[str, Any] | None = None,
    with_task: bool = True,
) -> None:
    """An event about a session: its instance, id, owner and (unless `with_task` is False, as
    for the attach and control events) its task."""
    events.publish(
        type_,
        actor=actor,
        instance_id=sess.instance_id,
        session_id=sess.id,
        task_id=sess.task_id if with_task else None,
        owner=sess.owner,
        data=data,
    )
