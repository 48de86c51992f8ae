"""One agent's live stream, as the rest of the server sees it.

The connection offers typed commands (`open_session`, `send_input`, `resize`, `signal`,
`close_session`, `ack`); protobuf is built here, never by its callers. A command never blocks:
it goes into a bounded outbox that one writer task drains into the gRPC stream (whose flow
control paces it). A connection whose outbox overflows is closed (the agent reconnects and the
session state is reconciled) rather than letting memory grow; a command on a closed link raises
`LinkClosed`. Output acknowledgements are coalesced: at once after 256 KiB, else within 20 ms.

`LinkHandler` is what the link tells the session layer, in the typed values of `messages.py`.
Byte streams (exec, …) live in `streams` (`streams.py`); their data frames are not in the
outbox: the writer sends the outbox first, then one stream frame at a time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentic_sandbox.broker.agentlink.messages import (
    Exited,
    Inventory,
    Opened,
    OpenRequest,
    Output,
    Reconciled,
    SignalName,
)
from agentic_sandbox.broker.agentlink.streams import LinkStreams
from agentic_sandbox.proto import PROTOCOL, gather
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

ACK_EVERY_BYTES = 256 * 1024
ACK_DELAY = 0.02
_PB_SIGNAL: dict[SignalName, pb.Signal.ValueType] = {
    "INT": pb.SIGNAL_INT,
    "TERM": pb.SIGNAL_TERM,
    "KILL": pb.SIGNAL_KILL,
    "HUP": pb.SIGNAL_HUP,
}


class LinkClosed(Exception):
    """The agent's stream is gone (or was closed for overflowing)."""


@dataclass
class AgentInfo:
    agent_version: str = ""
    hostname: str = ""
    boot_id: str = ""
    agent_run_id: str = ""
    ring_bytes: int = 0
    stream_kinds: tuple[str, ...] = ()  # what the agent accepts ("exec", …)
    budget_enforcement: str = ""  # cgroup-v2, cgroup-v1, none ("" before stream support)
    budgets: tuple[str, ...] = ()  # budget fields it enforces
    budget_problem: str = ""  # why it cannot enforce the others
    agent_bundle: str = ""  # the SHA-256 of the bundle the agent runs ("": an installed one)
    bundle_problem: str = ""  # why the bundle it last tried was rolled back
    session_dirs: bool = False  # it makes `OpenSession.make_dirs` (its Register said so)
    session_ids: frozenset[str] = frozenset()  # the sessions its registration held (any state)


@dataclass
class AgentMetrics:
    time_unix_ms: int = 0
    cpu_percent: float = 0.0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    disk_used_bytes: int = 0
    disk_total_bytes: int = 0
    load1: float = 0.0
    load5: float = 0.0
    load15: float = 0.0
    sessions: int = 0

    def take(self, hb: pb.Heartbeat) -> None:
        """The heartbeat's values, written over the last ones. In place, not a new object per
        heartbeat: each such object lived one interval, long enough to be promoted to the
        garbage collector's oldest generation, whose full collections take ~0.7 s with 5000
        links (measured; the change itself is within the 5000-link benchmark's noise)."""
        self.time_unix_ms = hb.time_unix_ms
        self.cpu_percent = round(hb.cpu_percent, 2)
        self.memory_used_bytes = hb.memory_used_bytes
        self.memory_total_bytes = hb.memory_total_bytes
        self.disk_used_bytes = hb.disk_used_bytes
        self.disk_total_bytes = hb.disk_total_bytes
        self.load1 = round(hb.load1, 2)
        self.load5 = round(hb.load5, 2)
        self.load15 = round(hb.load15, 2)
        self.sessions = hb.sessions

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class AgentConnection:
    instance_id: str
    incarnation: str  # the one the certificate names (a live incarnation when it connected)
    owner: str
    cert_serial: str
    cert_not_after: dt.datetime
    peer: str
    outbox_limit: int = 10_000
    stream_limit: int = 128
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    state: str = "connected"  # connected | stale | closed
    registered: bool = False
    connected_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    last_seen: float = 0.0  # loop time of the last message
    last_heartbeat_at: dt.datetime | None = None
    info: AgentInfo = field(default_factory=AgentInfo)
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    metrics_dirty: bool = False
    close_reason: str = ""
    batches: bool = False  # the agent takes batches (its Register said so): so does this link
    acks_when_asked: bool = False  # answer only the heartbeats that ask (its Register said so)

    def __post_init__(self) -> None:
        self._out: deque[pb.ServerMessage] = deque()
        self._wake = asyncio.Event()
        self._acks: dict[str, int] = {}
        self._acked: dict[str, int] = {}
        self._ack_timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[Any] | None = None  # the Connect handler, cancelled on close
        self.last_seen = asyncio.get_running_loop().time()
        self.streams = LinkStreams(self._send, self._wake.set, max_streams=self.stream_limit)

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    @property
    def ready(self) -> bool:
        return self.registered and self.state == "connected"

    # ---- commands (each raises LinkClosed when the link is gone) ----------------------------
    def open_session(self, req: OpenRequest) -> None:
        self._send(
            pb.ServerMessage(
                open=pb.OpenSession(
                    session_id=req.session_id,
                    command=req.command,
                    cols=req.cols,
                    rows=req.rows,
                    env=req.env,
                    cwd=req.cwd,
                    user=req.user,
                    task_id=req.task_id,
                    budget=req.budget.to_pb() if req.budget is not None else None,
                    make_dirs=req.make_dirs,
                    list_on_exit=req.list_on_exit,
                )
            )
        )

    def send_input(self, session_id: str, data: bytes) -> None:
        self._send(pb.ServerMessage(input=pb.SessionInput(session_id=session_id, data=data)))

    def resize(self, session_id: str, cols: int, rows: int) -> None:
        self._send(
            pb.ServerMessage(resize=pb.ResizeSession(session_id=session_id, cols=cols, rows=rows))
        )

    def signal(self, session_id: str, signal: SignalName) -> None:
        self._send(
            pb.ServerMessage(
                signal=pb.SignalSession(session_id=session_id, signal=_PB_SIGNAL[signal])
            )
        )

    def close_session(self, session_id: str, grace_ms: int = 0) -> None:
        """End a running session (HUP, then KILL after `grace_ms`), or forget an exited one."""
        self._send(
            pb.ServerMessage(close=pb.CloseSession(session_id=session_id, grace_ms=grace_ms))
        )

    def answer_register(self, server_id: str, heartbeat_ms: int, reconciled: Reconciled) -> None:
        self._send(
            pb.ServerMessage(
                register_ack=pb.RegisterAck(
                    server_id=server_id,
                    heartbeat_interval_ms=heartbeat_ms,
                    resume=[
                        pb.ResumeOutput(session_id=r.session_id, from_offset=r.from_offset)
                        for r in reconciled.resume
                    ],
                    close=reconciled.close,
                    protocol=PROTOCOL,
                    batches=self.batches,
                )
            )
        )

    def answer_heartbeat(self, server_time_unix_ms: int) -> None:
        self._send(
            pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(server_time_unix_ms=server_time_unix_ms))
        )

    def _send(self, msg: pb.ServerMessage) -> None:
        if self.closed:
            raise LinkClosed(f"agent link of {self.instance_id} is closed")
        if len(self._out) >= self.outbox_limit:
            self.close("outbox overflow: the agent does not read its stream")
            raise LinkClosed(f"agent link of {self.instance_id} overflowed")
        self._out.append(msg)
        self._wake.set()

    def ack(self, session_id: str, offset: int) -> None:
        """Acknowledge output up to `offset` (coalesced)."""
        self._acks[session_id] = offset
        if offset - self._acked.get(session_id, 0) >= ACK_EVERY_BYTES:
            self.flush_acks()
        elif self._ack_timer is None and not self.closed:
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_DELAY, self.flush_acks)

    def flush_acks(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        if self.closed:
            return
        acks, self._acks = self._acks, {}
        for sid, offset in acks.items():
            if offset > self._acked.get(sid, -1):
                self._acked[sid] = offset
                self._out.append(pb.ServerMessage(ack=pb.OutputAck(session_id=sid, offset=offset)))
        if acks:
            self._wake.set()

    def forget_session(self, session_id: str) -> None:
        self._acks.pop(session_id, None)
        self._acked.pop(session_id, None)

    async def outgoing(self) -> AsyncIterator[pb.ServerMessage]:
        """The messages to write to the stream, until the connection closes (what is ready at
        once as one batch, when the agent takes batches)."""
        while not self.closed:
            msg = self._next()
            if msg is not None:
                yield self._gather(msg) if self.batches else msg
                continue
            self._wake.clear()
            await self._wake.wait()
            if self.batches:
                await asyncio.sleep(0)  # callbacks already due queue theirs: one write

    def _next(self) -> pb.ServerMessage | None:
        if self._out:
            return self._out.popleft()
        return self.streams.next_message()

    def _gather(self, first: pb.ServerMessage) -> pb.ServerMessage:
        return gather(
            first, self._next, lambda ready: pb.ServerMessage(batch=pb.ServerBatch(messages=ready))
        )

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.state = "closed"
        self.close_reason = reason
        self.streams.close_all(reason)
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        self._wake.set()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class LinkHandler(Protocol):
    """What the agent link tells the session layer (implemented by the session hub)."""

    async def on_register(self, conn: AgentConnection, inventory: list[Inventory]) -> Reconciled:
        """Reconcile the agent's sessions; returns where each kept session's output resumes and
        which sessions the agent must end (or forget)."""
        ...

    def on_opened(self, conn: AgentConnection, opened: Opened) -> None: ...

    def on_output(self, conn: AgentConnection, output: Output) -> None: ...

    def on_exit(self, conn: AgentConnection, exited: Exited) -> None: ...

    def on_disconnect(self, conn: AgentConnection) -> None: ...
