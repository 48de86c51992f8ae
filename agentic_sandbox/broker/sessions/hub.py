"""The session hub: PTY sessions on agents, multiplexed to any number of clients.

Output arrives once from the agent link (`on_output`), is redacted, appended to the session's
ring, recorded, and fans out to every attached client and follower by waking their writers —
the hub never waits for a client. Input goes the other way at once (no batching).

Persistence: a session row is written when it is created and on every state change (through
one ordered background writer, so a state change never waits for the database on the output
path); the acknowledged output offset is written every few seconds. After a server restart the
hub loads every unfinished session; when its agent re-registers, the hub reconciles (keep what
the agent has, mark lost what it no longer has, adopt what the server lost track of, end what
must end) and asks for output from where its (empty) ring must start to hold the most the
agent still has — so a client reattaching with `from=<offset>` continues byte-exactly.

Everything an agent reports is untrusted: session ids must be the server's own (canonical
UUIDs, `broker.sessions.ids`) before they are looked up, stored or made into a file name, and a
message for a session of another instance, or one the hub does not hold, is dropped (the first
few per link are logged, all are counted). Adopting unknown sessions stops at the per-instance
session limit; the agent is told to end the rest.

Implements `broker.sessions.contract.SessionService` and the agent link's `LinkHandler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import Counter as MetricCounter
from sqlalchemy import select, update

from agentic_sandbox.broker.agentlink import (
    SIGNAL_NAMES,
    AgentConnection,
    Exited,
    ExitReport,
    Inventory,
    LinkClosed,
    Opened,
    OpenRequest,
    Output,
    Reconciled,
    Resume,
    SignalName,
)
from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.clients import AttachedClient, ClientTransport
from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    ExitStatus,
    OutputChunk,
    Prompt,
    PromptListener,
    SessionEnded,
    SessionError,
    SessionNotFound,
    SessionSpec,
)
from agentic_sandbox.broker.sessions.hitl import TAIL_BYTES, detect_prompt
from agentic_sandbox.broker.sessions.ids import UnsafePath, is_session_id, session_file, shown
from agentic_sandbox.broker.sessions.recording import Recording
from agentic_sandbox.broker.sessions.redaction import StreamRedactor
from agentic_sandbox.broker.sessions.ring import OutputRing
from agentic_sandbox.broker.sessions.screen import INCREMENTAL_MAX, ScreenTracker, Snapshot
from agentic_sandbox.broker.store import models as m

if TYPE_CHECKING:
    from agentic_sandbox.broker.agentlink.registry import AgentRegistry
    from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

ENDED = frozenset({"exited", "failed", "lost"})
LIVE = ("starting", "running", "killing")
SIGNALS: dict[str, SignalName] = {name: name for name in SIGNAL_NAMES}
HOUSEKEEPING_SECONDS = 0.25
OFFSET_PERSIST_SECONDS = 2.0
SECRETS_REFRESH_SECONDS = 10.0
FOLLOW_CHUNK = 256 * 1024
# Output offsets an agent may report: what a JavaScript client still holds exactly, far beyond
# any real session, and within the database's signed 64-bit column.
MAX_OFFSET = 2**53 - 1
REFUSALS_LOGGED_PER_LINK = 10  # then only counted (sandbox_agent_refusals_total)
MAX_CLOSE_REPLIES = 10_000  # sessions a registration answer tells the agent to end, at most
ID_LOOKUP_BATCH = 500
EXIT_REASON_CHARS = 2000
_SIGNAL_NAME = re.compile(r"[A-Z][A-Z0-9+-]{0,15}")


class TooManySessions(SessionError):
    """The instance has as many live sessions as the server allows."""


class SessionStartFailed(SessionError):
    """The agent could not start the command (not found, bad cwd or user, …)."""


class SessionOpenTimeout(SessionError):
    """The agent did not answer the open request in time."""


class Follower:
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
    state: str = "starting"
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

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def notify(self) -> None:
        for client in self.clients.values():
            client.wake.set()
        for follower in self.followers:
            follower.wake.set()

    def members(self) -> list[dict[str, str]]:
        return [c.member() for c in self.clients.values()]

    def observers(self) -> int:
        return sum(1 for c in self.clients.values() if c.role == proto.ROLE_OBSERVER)


def _exit_status(report: ExitReport) -> ExitStatus:
    """The agent's exit report, with its strings bounded (they reach rows, events and logs)."""
    signal = report.signal if _SIGNAL_NAME.fullmatch(report.signal) else None
    reason = report.error[:EXIT_REASON_CHARS]
    if report.signal and signal is None:
        reason = reason or "killed by a signal the agent named oddly"
    return ExitStatus(code=report.code, signal=signal, lost=False, reason=reason)


def _inventory_ok(inv: Inventory) -> bool:
    """Offsets an agent's session can really have."""
    return inv.ring_start <= inv.end_offset <= MAX_OFFSET


def _size(cols: int, rows: int) -> tuple[int, int]:
    """A terminal size reported by an agent, within what the protocol allows (0: not known)."""
    return min(cols, proto.MAX_COLS), min(rows, proto.MAX_ROWS)


class SessionHub:
    """The server's `SessionService`."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.metrics = svc.metrics
        self.events = svc.events
        self.audit = svc.audit
        self.db = svc.db
        self.registry: AgentRegistry | None = None
        self.recordings_dir = svc.settings.data_dir / "recordings"
        self._sessions: dict[str, HubSession] = {}
        self._prompt_listeners: list[PromptListener] = []
        # Pending row updates, merged per session (bounded by the number of sessions).
        self._dbq: dict[str, dict[str, Any]] = {}
        self._db_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._relayed = self.metrics.session_relayed_bytes
        self._output_bytes = self.metrics.session_output_bytes
        self._last_offset_persist = 0.0
        self._last_secrets_refresh = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refusals: dict[str, int] = {}  # per agent link (its id): refusals so far
        self._m_refused = MetricCounter(
            "sandbox_agent_refusals_total",
            "Agent reports the session hub refused, by reason (bad-id, not-owned, unknown, "
            "bad-offset, bad-inventory, over-cap)",
            ["reason"],
            registry=self.metrics.registry,
        )
        self.metrics.provide(
            "sandbox_sessions",
            "Sessions held by the hub, by state",
            ("state",),
            self._by_state,
        )
        self.metrics.provide(
            "sandbox_session_clients",
            "Clients attached to sessions, by role",
            ("role",),
            self._clients_by_role,
        )

    def _by_state(self) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {(st,): 0.0 for st in ("starting", "running")}
        for s in self._sessions.values():
            key = (s.state,)
            out[key] = out.get(key, 0.0) + 1
        return out

    def _clients_by_role(self) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {
            (proto.ROLE_CONTROLLER,): 0.0,
            (proto.ROLE_OBSERVER,): 0.0,
        }
        for s in self._sessions.values():
            for c in s.clients.values():
                out[(c.role,)] += 1
        return out

    # ================================================================================ lifecycle
    def use_registry(self, registry: AgentRegistry) -> None:
        self.registry = registry

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.recordings_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.recordings_dir.chmod(0o700)
        async with self.db.session() as s:
            rows = (await s.scalars(select(m.Session).where(m.Session.state.in_(LIVE)))).all()
        for row in rows:
            sess = self._from_row(row)
            sess.synced = False
            self._add(sess)
        if rows:
            log.info("loaded %d unfinished sessions; waiting for their agents", len(rows))
        self._tasks = [
            asyncio.create_task(self._db_writer(), name="session-db-writer"),
            asyncio.create_task(self._housekeeping(), name="session-housekeeping"),
        ]

    async def stop(self) -> None:
        for sess in list(self._sessions.values()):
            for client in list(sess.clients.values()):
                client.queue(proto.error("server-shutdown", "the server is shutting down"))
                client.kick("server shutting down")
            for follower in sess.followers:
                follower.wake.set()
            if sess.recording is not None:
                sess.recording.flush()
            if sess.ring.end != sess.persisted_offset:
                self._persist(sess.id, output_offset=sess.ring.end)
        await asyncio.sleep(0)
        for task in self._tasks:
            if task.get_name() == "session-db-writer":
                continue
            task.cancel()
        with contextlib.suppress(Exception):
            await self._flush_db()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sess in self._sessions.values():
            if sess.recording is not None:
                sess.recording.close()

    def _from_row(self, row: m.Session) -> HubSession:
        sess = HubSession(
            id=row.id,
            instance_id=row.instance_id,
            owner=row.owner,
            name=row.name,
            command=list(row.command) if row.command else None,
            cols=row.cols,
            rows=row.rows,
            created_at=row.created_at,
            ring=OutputRing(self.settings.session_ring_bytes, base=row.output_offset),
            incarnation=row.incarnation,
            task_id=row.task_id,
            cwd=row.cwd,
            user=row.user,
            state=row.state,
            recv_end=row.output_offset,
            persisted_offset=row.output_offset,
            kill_requested=row.state == "killing",
            recording_path=row.recording_path,
        )
        if row.recording_path and self.settings.session_recording:
            path = self.recording_file(row.id)
            if path is None:
                log.warning(
                    "session %s: not a session id the server makes; its recording is not resumed",
                    shown(row.id),
                )
            else:
                sess.recording = Recording.resume(
                    path,
                    started_wall=row.created_at.timestamp(),
                    max_bytes=self.settings.session_recording_max_bytes,
                    record_input=self.settings.session_recording_input,
                )
        return sess

    def recording_file(self, session_id: str) -> Path | None:
        """The recording file of a session, `<recordings>/<id>.cast`, for a well-formed id and
        resolving inside the recordings directory; None otherwise. Always derived from the id:
        a row's `recording_path` only says that the session is recorded (a stored path is
        never opened, so a row cannot point the server at another file)."""
        try:
            return session_file(self.recordings_dir, session_id, ".cast")
        except UnsafePath:
            return None

    def _add(self, sess: HubSession) -> None:
        self._sessions[sess.id] = sess

    # ============================================================================ persistence
    def _persist(self, session_id: str, **values: Any) -> None:
        self._dbq.setdefault(session_id, {}).update(values)
        self._db_wake.set()

    async def _flush_db(self) -> None:
        while self._dbq:
            batch, self._dbq = self._dbq, {}
            now = dt.datetime.now(dt.UTC)
            try:
                async with self.db.session() as s:
                    for sid, values in batch.items():
                        await s.execute(
                            update(m.Session)
                            .where(m.Session.id == sid)
                            .values(**values, updated_at=now)
                        )
            except BaseException:
                for sid, values in batch.items():  # keep them, newer values win
                    self._dbq[sid] = {**values, **self._dbq.get(sid, {})}
                raise

    async def _db_writer(self) -> None:
        while True:
            await self._db_wake.wait()
            self._db_wake.clear()
            try:
                await self._flush_db()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("writing session state failed; retrying")
                await asyncio.sleep(1)
                self._db_wake.set()

    async def _housekeeping(self) -> None:
        loop = asyncio.get_running_loop()
        stall = self.settings.session_client_stall_seconds
        retain = self.settings.session_retain_seconds
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            now = loop.time()
            persist_offsets = now - self._last_offset_persist >= OFFSET_PERSIST_SECONDS
            if persist_offsets:
                self._last_offset_persist = now
            if now - self._last_secrets_refresh >= SECRETS_REFRESH_SECONDS:
                self._last_secrets_refresh = now
                await self._refresh_secrets()
            for sess in list(self._sessions.values()):
                if sess.recording is not None:
                    try:
                        sess.recording.flush()
                    except OSError:
                        log.exception("flushing recording of %s failed", sess.id)
                for client in list(sess.clients.values()):
                    since = client.sending_since
                    if since is not None and now - since > stall:
                        self._drop_stuck(sess, client, now - since)
                if persist_offsets and sess.ring.end != sess.persisted_offset:
                    sess.persisted_offset = sess.ring.end
                    self._persist(sess.id, output_offset=sess.ring.end)
                if (
                    sess.ended
                    and sess.ended_mono is not None
                    and now - sess.ended_mono > retain
                    and not sess.clients
                    and not sess.followers
                ):
                    self._evict(sess)

    async def _refresh_secrets(self) -> None:
        """Secrets bound or changed after a session started are redacted from then on."""
        instances = {s.instance_id for s in self._sessions.values() if not s.ended}
        for instance_id in instances:
            values = (await self._secrets(instance_id)).values()
            for sess in list(self._sessions.values()):
                if sess.instance_id == instance_id and not sess.ended:
                    sess.redactor.set(values)
                    if sess.redactor.held:  # what was held may no longer start a secret
                        released = sess.redactor.feed(b"")
                        if released:
                            self._append(sess, released)

    def _evict(self, sess: HubSession) -> None:
        if sess.recording is not None:
            sess.recording.close()
        sess.ring.release()
        sess.screen = None
        self._sessions.pop(sess.id, None)

    def _drop_stuck(self, sess: HubSession, client: AttachedClient, seconds: float) -> None:
        log.warning(
            "client %s of session %s stuck in a send for %.1fs; disconnecting it",
            client.id,
            sess.id,
            seconds,
            extra={"session_id": sess.id, "client": client.id, "subject": client.subject},
        )
        self.metrics.session_client_drops.inc()
        client.kick(f"stuck in a send for {seconds:.1f}s")
        self.detach(client)

    # ============================================================================== queries
    def get(self, session_id: str) -> HubSession | None:
        return self._sessions.get(session_id)

    def _require(self, session_id: str) -> HubSession:
        sess = self._sessions.get(session_id)
        if sess is None:
            raise SessionNotFound(session_id)
        return sess

    def sessions(self) -> list[HubSession]:
        return list(self._sessions.values())

    def snapshot(self, sess: HubSession) -> Snapshot:
        if sess.screen is None:
            sess.screen = ScreenTracker(sess.cols, sess.rows)
        return sess.screen.snapshot(sess.ring)

    def screen(self, sess: HubSession) -> ScreenTracker:
        if sess.screen is None:
            sess.screen = ScreenTracker(sess.cols, sess.rows)
        sess.screen.catch_up(sess.ring)
        return sess.screen

    def relayed(self, n: int) -> None:
        self._relayed.inc(n)

    def exit_message(self, sess: HubSession) -> str:
        ex = sess.exit or ExitStatus(code=None, lost=True)
        return proto.dumps(
            {
                "type": "exit",
                "code": ex.code,
                "signal": ex.signal,
                "lost": ex.lost,
                "reason": ex.reason,
                "offset": sess.ring.end,
            }
        )

    # ============================================================================= contract
    def agent_ready(self, instance_id: str) -> bool:
        return self.registry is not None and self.registry.ready(instance_id)

    def _link(self, instance_id: str) -> AgentConnection:
        conn = self.registry.get(instance_id) if self.registry is not None else None
        if conn is None or not conn.ready:
            raise AgentUnavailable(f"the agent of instance {instance_id!r} is not connected")
        return conn

    async def _secrets(self, instance_id: str) -> dict[str, str]:
        try:
            return await self.svc.vault.values_for_instance(instance_id)
        except Exception:
            log.exception("reading secrets of %s failed; none are passed or redacted", instance_id)
            return {}

    async def create(self, spec: SessionSpec, *, actor: str) -> str:
        conn = self._link(spec.instance_id)
        live = sum(
            1 for s in self._sessions.values() if s.instance_id == spec.instance_id and not s.ended
        )
        if live >= self.settings.session_max_per_instance:
            raise TooManySessions(
                f"instance {spec.instance_id!r} has {live} live sessions (the limit)"
            )
        cols = max(1, min(proto.MAX_COLS, spec.cols))
        rows = max(1, min(proto.MAX_ROWS, spec.rows))
        secrets_env = await self._secrets(spec.instance_id)
        sid = str(uuid.uuid4())
        now = dt.datetime.now(dt.UTC)
        sess = HubSession(
            id=sid,
            instance_id=spec.instance_id,
            owner=spec.owner,
            name=spec.name,
            command=list(spec.command) if spec.command else None,
            cols=cols,
            rows=rows,
            created_at=now,
            ring=OutputRing(self.settings.session_ring_bytes),
            incarnation=conn.incarnation,
            task_id=spec.task_id,
            cwd=spec.cwd,
            user=spec.user,
        )
        sess.redactor.set(secrets_env.values())
        if self.settings.session_recording:
            path = session_file(self.recordings_dir, sid, ".cast")
            sess.recording = Recording.create(
                path,
                cols=cols,
                rows=rows,
                title=spec.name,
                command=sess.command,
                started_wall=now.timestamp(),
                max_bytes=self.settings.session_recording_max_bytes,
                record_input=self.settings.session_recording_input,
            )
            sess.recording_path = str(path)
        async with self.db.session() as s:
            s.add(
                m.Session(
                    id=sid,
                    instance_id=spec.instance_id,
                    incarnation=conn.incarnation,
                    owner=spec.owner,
                    name=spec.name,
                    command=sess.command,
                    cols=cols,
                    rows=rows,
                    cwd=spec.cwd,
                    user=spec.user,
                    env=dict(spec.env),  # never the secrets
                    state="starting",
                    task_id=spec.task_id,
                    recording_path=sess.recording_path,
                    created_at=now,
                )
            )
        self._add(sess)
        loop = asyncio.get_running_loop()
        sess.opening = loop.create_future()
        request = OpenRequest(
            session_id=sid,
            command=sess.command or [],
            cols=cols,
            rows=rows,
            env={**secrets_env, **spec.env},
            cwd=spec.cwd or "",
            user=spec.user or "",
            task_id=spec.task_id or "",
        )
        try:
            conn.open_session(request)
            opened = await asyncio.wait_for(
                asyncio.shield(sess.opening), self.settings.session_open_timeout_seconds
            )
        except (LinkClosed, AgentUnavailable) as exc:
            self._fail(sess, f"agent link lost while opening: {exc}", actor)
            raise AgentUnavailable(str(exc)) from None
        except TimeoutError:
            self._fail(sess, "the agent did not answer in time", actor)
            raise SessionOpenTimeout("the agent did not open the session in time") from None
        finally:
            sess.opening = None
        if not opened.ok:
            self._fail(sess, opened.error or "the agent could not start the command", actor)
            raise SessionStartFailed(f"the agent could not start the session: {opened.error}")
        if sess.state == "starting":
            sess.state = "running"
            self._persist(sid, state="running")
        self.metrics.sessions_opened.labels("ok").inc()
        self.audit.transition(
            actor,
            "session",
            sid,
            "starting",
            "running",
            cause="created",
            detail={"instance_id": spec.instance_id},
        )
        self.events.publish(
            "session.created",
            actor=actor,
            instance_id=spec.instance_id,
            session_id=sid,
            task_id=spec.task_id,
            owner=spec.owner,
            data={
                "name": spec.name,
                "command": sess.command,
                "cols": cols,
                "rows": rows,
                "pid": opened.pid,
            },
        )
        return sid

    def _fail(self, sess: HubSession, reason: str, actor: str) -> None:
        self.metrics.sessions_opened.labels("failed").inc()
        self._end(sess, "failed", ExitStatus(code=None, lost=False, reason=reason), actor=actor)

    async def write(self, session_id: str, data: bytes, *, actor: str) -> None:
        sess = self._require(session_id)
        if sess.ended:
            raise SessionEnded(session_id)
        self._send_input(sess, data)

    def _send_input(self, sess: HubSession, data: bytes) -> None:
        conn = self._link(sess.instance_id)
        try:
            conn.send_input(sess.id, data)
        except LinkClosed as exc:
            raise AgentUnavailable(str(exc)) from None
        self.metrics.session_input_bytes.inc(len(data))
        if sess.recording is not None:
            sess.recording.input(data)

    async def signal(self, session_id: str, signal: str, *, actor: str) -> None:
        sess = self._require(session_id)
        if sess.ended:
            raise SessionEnded(session_id)
        sig = SIGNALS.get(signal.upper().removeprefix("SIG"))
        if sig is None:
            raise SessionError(f"unknown signal {signal!r}; use INT, TERM, KILL or HUP")
        conn = self._link(sess.instance_id)
        try:
            conn.signal(sess.id, sig)
        except LinkClosed as exc:
            raise AgentUnavailable(str(exc)) from None
        self.audit.record(
            actor, "session.signal", "session", sess.id, detail={"signal": signal.upper()}
        )

    async def kill(self, session_id: str, *, actor: str) -> None:
        sess = self._require(session_id)
        if sess.ended:
            return
        first = not sess.kill_requested
        sess.kill_requested = True
        if first:
            self.audit.record(actor, "session.kill", "session", sess.id)
            self.events.publish(
                "session.kill_requested",
                actor=actor,
                instance_id=sess.instance_id,
                session_id=sess.id,
                task_id=sess.task_id,
                owner=sess.owner,
            )
        if sess.state != "starting":
            sess.state = "killing"
            self._persist(sess.id, state="killing")
        conn = self.registry.get(sess.instance_id) if self.registry is not None else None
        if conn is not None and conn.ready:
            with contextlib.suppress(LinkClosed):
                conn.close_session(sess.id, int(self.settings.session_kill_grace_seconds * 1000))
        # else: the agent is told to end it when it registers again

    def follow_output(self, session_id: str, from_offset: int = 0) -> AsyncIterator[OutputChunk]:
        sess = self._require(session_id)
        return self._follow(sess, max(0, from_offset))

    async def _follow(self, sess: HubSession, offset: int) -> AsyncIterator[OutputChunk]:
        follower = Follower()
        sess.followers.add(follower)
        try:
            while True:
                follower.wake.clear()
                ring = sess.ring
                if offset < ring.start and (sess.synced or sess.ended):
                    offset = ring.start  # the ring no longer holds it: continue at the oldest
                if ring.start <= offset < ring.end:
                    data = ring.read(offset, FOLLOW_CHUNK)
                    yield OutputChunk(offset, data)
                    offset += len(data)
                    continue
                if sess.ended and offset >= ring.end:
                    return
                if self._sessions.get(sess.id) is not sess:
                    return  # evicted or the hub stopped
                await follower.wake.wait()
        finally:
            sess.followers.discard(follower)

    async def wait_exit(self, session_id: str) -> ExitStatus:
        sess = self._sessions.get(session_id)
        if sess is not None:
            if sess.exit is not None:
                return sess.exit
            fut: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
            sess.exit_waiters.append(fut)
            return await fut
        async with self.db.session() as s:
            row = await s.get(m.Session, session_id)
        if row is None:
            raise SessionNotFound(session_id)
        if row.state not in ENDED:
            raise SessionError(f"session {session_id} is not held by this server")
        return ExitStatus(
            code=row.exit_code,
            signal=row.exit_signal,
            lost=row.state == "lost",
            reason=row.exit_reason,
        )

    async def end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's sessions end at once (lost: the instance is gone); their
        clients are told, get the exit and are closed by their writers (input is refused from
        now on), their followers (task runs) see the end."""
        for sess in list(self._sessions.values()):
            if sess.instance_id != ended.instance_id or sess.ended:
                continue
            if sess.incarnation not in (None, ended.incarnation):
                continue
            for client in list(sess.clients.values()):
                client.queue(proto.error("instance-deleted", "the instance was deleted"))
            self._end(
                sess,
                "lost",
                ExitStatus(code=None, lost=True, reason=f"the instance ended: {ended.reason}"),
                actor=ended.actor,
            )

    def add_prompt_listener(self, listener: PromptListener) -> None:
        self._prompt_listeners.append(listener)

    # ============================================================================ session end
    def _end(self, sess: HubSession, state: str, status: ExitStatus, *, actor: str) -> None:
        if sess.ended:
            return
        previous = sess.state
        leftover = sess.redactor.mask_held()  # the stream ends inside what may be a secret
        if leftover:
            self._append(sess, leftover)
        sess.state = state
        sess.exit = status
        sess.ended_mono = asyncio.get_running_loop().time()
        if sess.quiet_timer is not None:
            sess.quiet_timer.cancel()
            sess.quiet_timer = None
        if sess.recording is not None:
            try:
                sess.recording.close()
            except OSError:
                log.exception("closing recording of %s failed", sess.id)
        now = dt.datetime.now(dt.UTC)
        sess.ended_at = now
        sess.persisted_offset = sess.ring.end
        self._persist(
            sess.id,
            state=state,
            exit_code=status.code,
            exit_signal=status.signal,
            exit_reason=status.reason[:2000],
            ended_at=now,
            output_offset=sess.ring.end,
        )
        how = (
            "lost"
            if state == "lost"
            else (
                "killed" if sess.kill_requested else ("failed" if state == "failed" else "exited")
            )
        )
        self.metrics.session_ends.labels(how).inc()
        self.audit.transition(
            actor,
            "session",
            sess.id,
            previous,
            state,
            cause=status.reason or how,
            detail={"code": status.code, "signal": status.signal},
        )
        self.events.publish(
            f"session.{'exited' if state == 'exited' else state}",
            actor=actor,
            instance_id=sess.instance_id,
            session_id=sess.id,
            task_id=sess.task_id,
            owner=sess.owner,
            data={
                "code": status.code,
                "signal": status.signal,
                "lost": status.lost,
                "reason": status.reason,
                "output_bytes": sess.ring.end,
                "killed": sess.kill_requested,
            },
        )
        for fut in sess.exit_waiters:
            if not fut.done():
                fut.set_result(status)
        sess.exit_waiters.clear()
        if sess.opening is not None and not sess.opening.done():
            sess.opening.set_exception(SessionError(status.reason or "session ended"))
        sess.notify()

    # ================================================================================= output
    def _append(self, sess: HubSession, data: bytes) -> None:
        start = sess.ring.end
        sess.ring.append(data)
        self._output_bytes.inc(len(data))
        if sess.recording is not None:
            sess.recording.output(start, data)
        loop = self._loop or asyncio.get_running_loop()
        sess.last_output = loop.time()
        if sess.quiet_timer is None and not sess.ended:
            sess.quiet_timer = loop.call_later(self._hitl_quiet(), self._on_quiet, sess)
        sess.notify()

    def _hitl_quiet(self) -> float:
        return self.settings.session_hitl_quiet_ms / 1000.0

    def _on_quiet(self, sess: HubSession) -> None:
        sess.quiet_timer = None
        if sess.ended:
            return
        loop = self._loop or asyncio.get_running_loop()
        idle = loop.time() - sess.last_output
        quiet = self._hitl_quiet()
        if idle < quiet:
            sess.quiet_timer = loop.call_later(quiet - idle, self._on_quiet, sess)
            return
        if sess.screen is not None and 0 < sess.ring.end - sess.screen.offset <= INCREMENTAL_MAX:
            sess.screen.catch_up(sess.ring)  # keep the screen warm while idle
        if sess.prompt_checked == sess.ring.end:
            return
        sess.prompt_checked = sess.ring.end
        text = detect_prompt(sess.ring.tail(TAIL_BYTES))
        if text is None:
            return
        prompt = Prompt(session_id=sess.id, text=text, offset=sess.ring.end)
        self.metrics.hitl_prompts.inc()
        self.events.publish(
            "session.prompt",
            actor=f"agent:{sess.instance_id}",
            instance_id=sess.instance_id,
            session_id=sess.id,
            task_id=sess.task_id,
            owner=sess.owner,
            data={"text": text, "offset": prompt.offset},
        )
        for listener in list(self._prompt_listeners):
            try:
                listener(prompt)
            except Exception:
                log.exception("prompt listener failed")

    # ========================================================================== link handler
    @staticmethod
    def _belongs(sess: HubSession, conn: AgentConnection) -> bool:
        """A session is an agent's when it is of the agent's instance *and* incarnation."""
        return sess.instance_id == conn.instance_id and sess.incarnation in (
            None,
            conn.incarnation,
        )

    def _refuse(self, conn: AgentConnection, what: str, reason: str, session_id: str) -> None:
        """Drop one agent message: counted always, logged for the first few of each link."""
        self._m_refused.labels(reason).inc()
        n = self._refusals.get(conn.id, 0) + 1
        self._refusals[conn.id] = n
        if n > REFUSALS_LOGGED_PER_LINK:
            return
        log.warning(
            "agent %s: %s for session %s refused (%s)%s",
            conn.instance_id,
            what,
            shown(session_id),
            reason,
            "; further refusals on this link are only counted (sandbox_agent_refusals_total)"
            if n == REFUSALS_LOGGED_PER_LINK
            else "",
            extra={"instance_id": conn.instance_id, "reason": reason},
        )

    def _mine(self, conn: AgentConnection, session_id: str, what: str) -> HubSession | None:
        """The session a message of this agent is about, if it is one of the agent's own (of
        its instance and incarnation)."""
        sess = self._sessions.get(session_id)  # keys are ids the server made or checked
        if sess is not None and self._belongs(sess, conn):
            return sess
        if sess is not None:
            reason = "not-owned"
        elif is_session_id(session_id):
            reason = "unknown"
        else:
            reason = "bad-id"
        self._refuse(conn, what, reason, session_id)
        return None

    def on_output(self, conn: AgentConnection, msg: Output) -> None:
        sess = self._sessions.get(msg.session_id)
        if sess is None or not self._belongs(sess, conn):
            self._mine(conn, msg.session_id, "output")
            return
        data = msg.data
        offset = msg.offset
        end = sess.recv_end
        n = len(data)
        if offset + n <= end:
            return  # already have it
        if offset + n > MAX_OFFSET:
            self._refuse(conn, "output", "bad-offset", sess.id)
            return
        if offset < end:
            data = data[end - offset :]
            offset = end
        elif offset > end:
            log.warning(
                "session %s: output gap %d..%d (the agent's ring no longer held it)",
                sess.id,
                end,
                offset,
                extra={"session_id": sess.id},
            )
            held = sess.redactor.mask_held()  # what it began is lost: it may be a secret's start
            if held:
                self._append(sess, held)
            sess.ring.reset(offset)
        sess.recv_end = offset + len(data)
        out = sess.redactor.feed(data) if sess.redactor.active else data
        if out:
            self._append(sess, out)
        conn.ack(sess.id, sess.ring.end)

    def on_opened(self, conn: AgentConnection, msg: Opened) -> None:
        sess = self._mine(conn, msg.session_id, "opened")
        if sess is None:
            return
        if sess.opening is not None and not sess.opening.done():
            msg.error = msg.error[:EXIT_REASON_CHARS]
            sess.opening.set_result(msg)

    def on_exit(self, conn: AgentConnection, msg: Exited) -> None:
        sess = self._mine(conn, msg.session_id, "exit")
        if sess is None:
            return
        if not sess.ended:
            if msg.end_offset > sess.recv_end:
                log.warning(
                    "session %s exited with output %d..%d missing",
                    sess.id,
                    sess.recv_end,
                    min(msg.end_offset, MAX_OFFSET),
                )
            status = _exit_status(msg.exit)
            if msg.exit.error and msg.exit.code is None and not msg.exit.signal:
                self._end(sess, "failed", status, actor=f"agent:{conn.instance_id}")
            else:
                self._end(sess, "exited", status, actor=f"agent:{conn.instance_id}")
        conn.forget_session(sess.id)
        with contextlib.suppress(LinkClosed):
            conn.close_session(sess.id)

    def on_disconnect(self, conn: AgentConnection) -> None:
        self._refusals.pop(conn.id, None)
        current = self.registry.get(conn.instance_id) if self.registry is not None else None
        if current is not None and current is not conn:
            return  # replaced by a newer link, which has registered already
        for sess in self._sessions.values():
            if sess.instance_id != conn.instance_id or sess.ended:
                continue
            dropped = sess.redactor.drop_held()
            sess.recv_end = sess.ring.end
            if dropped:
                log.debug("session %s: %d held bytes will be resent", sess.id, dropped)
            if sess.opening is not None and not sess.opening.done():
                sess.opening.set_exception(AgentUnavailable("agent link lost"))
            for client in sess.clients.values():
                client.queue(
                    proto.error(
                        "agent-disconnected",
                        "the agent's link dropped; output resumes when it reconnects",
                    )
                )

    async def on_register(self, conn: AgentConnection, register: list[Inventory]) -> Reconciled:
        refused: Counter[str] = Counter()
        inventory: dict[str, Inventory] = {}
        impossible: set[str] = set()  # well-formed ids whose report cannot be true
        for item in register:
            if not is_session_id(item.session_id):
                refused["bad-id"] += 1  # never looked up, stored or echoed back
            elif not _inventory_ok(item):
                refused["bad-inventory"] += 1
                impossible.add(item.session_id)
            else:
                inventory[item.session_id] = item
        for sid in impossible & inventory.keys():  # one impossible report for an id is enough
            del inventory[sid]
        resume: list[Resume] = []
        close: list[str] = []
        actor = f"agent:{conn.instance_id}"
        for sess in [s for s in self._sessions.values() if s.instance_id == conn.instance_id]:
            if not self._belongs(sess, conn):
                continue  # an earlier instance's with this id: never this agent's
            inv = inventory.pop(sess.id, None)
            bad = sess.id in impossible
            impossible.discard(sess.id)
            if sess.ended:
                if inv is not None or bad:
                    close.append(sess.id)
                continue
            if inv is None:
                if bad:
                    close.append(sess.id)
                self._end(
                    sess,
                    "lost",
                    ExitStatus(
                        code=None,
                        lost=True,
                        reason="the agent reported impossible output offsets for this session"
                        if bad
                        else "the agent no longer has this session (it restarted?)",
                    ),
                    actor=actor,
                )
                continue
            resume.append(Resume(sess.id, self._resume_point(sess, inv)))
            if sess.kill_requested:
                close.append(sess.id)
        close.extend(impossible)  # unknown to this instance: end them
        if inventory:
            await self._adopt(conn, inventory, resume, close, refused)
        if len(close) > MAX_CLOSE_REPLIES:
            refused["unanswered"] += len(close) - MAX_CLOSE_REPLIES
            del close[MAX_CLOSE_REPLIES:]
        if refused:
            for reason, count in refused.items():
                self._m_refused.labels(reason).inc(count)
            log.warning(
                "agent %s registered with sessions the server refused: %s; it is told to end "
                "the well-formed ones",
                conn.instance_id,
                ", ".join(f"{count} {reason}" for reason, count in sorted(refused.items())),
                extra={"instance_id": conn.instance_id, "refused": dict(refused)},
            )
        if resume or close:
            log.info(
                "agent %s registered: %d sessions resumed, %d to end",
                conn.instance_id,
                len(resume),
                len(close),
                extra={"instance_id": conn.instance_id},
            )
        return Reconciled(resume, close)

    def _resume_point(self, sess: HubSession, inv: Inventory) -> int:
        ring = sess.ring
        # After a restart the ring is empty: refill it with the most the agent still holds.
        frm = ring.end if sess.synced else max(inv.ring_start, inv.end_offset - ring.capacity)
        frm = max(frm, inv.ring_start)
        frm = min(frm, inv.end_offset)
        sess.agent_end = inv.end_offset
        if frm != ring.end or not sess.synced:
            if frm != ring.end:
                held = sess.redactor.drop_held()
                if held:
                    log.debug("session %s: dropped %d held bytes at resync", sess.id, held)
                ring.reset(frm)
                if sess.screen is not None:
                    sess.screen.offset = -1
            sess.recv_end = frm
        sess.synced = True
        for client in sess.clients.values():
            client.catchup_until = max(client.catchup_until, inv.end_offset)
        cols, rows = _size(inv.cols, inv.rows)
        if cols and rows and (cols, rows) != (sess.cols, sess.rows):
            sess.cols, sess.rows = cols, rows
            if sess.screen is not None:
                sess.screen.resize(cols, rows)
        if sess.state == "starting" and inv.running:
            sess.state = "running"
            self._persist(sess.id, state="running")
        sess.notify()
        return frm

    async def _adopt(
        self,
        conn: AgentConnection,
        unknown: dict[str, Inventory],
        resume: list[Resume],
        close: list[str],
        refused: Counter[str],
    ) -> None:
        """Sessions the agent holds that this instance's hub does not: adopt them while the
        instance is under its session limit; end the rest, and any that is another instance's
        or has ended."""
        iid = conn.instance_id
        room = self.settings.session_max_per_instance - sum(
            1 for s in self._sessions.values() if s.instance_id == iid and not s.ended
        )
        pending: list[tuple[str, Inventory]] = []
        for sid, inv in unknown.items():
            if sid in self._sessions:  # held for another instance (this one's matched above)
                refused["not-owned"] += 1
                close.append(sid)
            else:
                pending.append((sid, inv))
        known_rows: list[tuple[m.Session, Inventory]] = []
        new: list[tuple[str, Inventory]] = []
        looked = 0
        while looked < len(pending) and room > 0:
            batch = pending[looked : looked + ID_LOOKUP_BATCH]
            looked += len(batch)
            async with self.db.session() as s:
                found = {
                    r.id: r
                    for r in await s.scalars(
                        select(m.Session).where(m.Session.id.in_([sid for sid, _ in batch]))
                    )
                }
            for sid, inv in batch:
                row = found.get(sid)
                if row is not None and (
                    row.instance_id != iid
                    or (row.incarnation is not None and row.incarnation != conn.incarnation)
                ):
                    refused["not-owned"] += 1  # another instance's, or an earlier one's
                    close.append(sid)
                elif row is not None and row.state in ENDED:
                    close.append(sid)  # it ended while the agent was away
                elif room <= 0:
                    refused["over-cap"] += 1
                    close.append(sid)
                else:
                    room -= 1
                    if row is None:
                        new.append((sid, inv))
                    else:
                        known_rows.append((row, inv))
        for sid, _ in pending[looked:]:
            refused["over-cap"] += 1
            close.append(sid)
        if new:
            known_rows += await self._adopt_rows(conn, new)
        if not known_rows:
            return
        secrets = (await self._secrets(iid)).values()
        for row, inv in known_rows:
            sess = self._from_row(row)
            sess.synced = False
            sess.redactor.set(secrets)
            self._add(sess)
            resume.append(Resume(row.id, self._resume_point(sess, inv)))

    async def _adopt_rows(
        self, conn: AgentConnection, new: list[tuple[str, Inventory]]
    ) -> list[tuple[m.Session, Inventory]]:
        """Rows (and recordings) for sessions the server lost track of (e.g. its database was
        reset), owned by the instance's owner."""
        iid = conn.instance_id
        claimed = {inv.task_id for _, inv in new if is_session_id(inv.task_id)}
        tasks: set[str] = set()
        if claimed:  # a task id is kept only when it names a task of this instance
            async with self.db.session() as s:
                tasks = set(
                    await s.scalars(
                        select(m.Task.id).where(m.Task.id.in_(claimed), m.Task.instance_id == iid)
                    )
                )
        now = dt.datetime.now(dt.UTC)
        rows: list[tuple[m.Session, Inventory]] = []
        for sid, inv in new:
            cols, rows_ = _size(inv.cols, inv.rows)
            row = m.Session(
                id=sid,
                instance_id=iid,
                incarnation=conn.incarnation,
                owner=conn.owner,
                name="adopted",
                command=None,
                cols=cols or 80,
                rows=rows_ or 24,
                env={},
                state="running",
                task_id=inv.task_id if inv.task_id in tasks else None,
                output_offset=inv.ring_start,
                created_at=now,
            )
            if self.settings.session_recording:
                row.recording_path = self._adopted_recording(row, inv.ring_start)
            rows.append((row, inv))
        try:
            async with self.db.session() as s:
                s.add_all([row for row, _ in rows])
        except BaseException:
            for row, _ in rows:
                if row.recording_path:
                    self._discard_recording(Path(row.recording_path))
            raise
        for row, _ in rows:
            self.metrics.sessions_opened.labels("adopted").inc()
            self.events.publish(
                "session.adopted",
                actor=f"agent:{iid}",
                instance_id=iid,
                session_id=row.id,
                task_id=row.task_id,
                owner=conn.owner,
                data={"reason": "the agent had a session the server did not know"},
            )
        return rows

    def _adopted_recording(self, row: m.Session, offset: int) -> str | None:
        """A new recording for an adopted session (never an existing file: when one is there,
        whoever made it, it is left alone and the session is not recorded)."""
        path = self.recording_file(row.id)
        if path is None:
            return None
        try:
            rec = Recording.create(
                path,
                cols=row.cols,
                rows=row.rows,
                title="adopted",
                command=None,
                started_wall=row.created_at.timestamp(),
                max_bytes=self.settings.session_recording_max_bytes,
                record_input=self.settings.session_recording_input,
            )
        except FileExistsError:
            log.warning(
                "session %s: a recording with its name exists already; it is left as it is and "
                "the adopted session is not recorded",
                row.id,
                extra={"session_id": row.id},
            )
            return None
        except OSError:
            log.exception("creating the recording of adopted session %s failed", row.id)
            return None
        rec.offset = offset  # what came before is not on this server
        rec.close()
        return str(path)

    @staticmethod
    def _discard_recording(path: Path) -> None:
        for p in (path, Path(str(path) + ".ckpt")):
            with contextlib.suppress(OSError):
                p.unlink()

    # =========================================================================== clients
    def may_control(self, sess: HubSession, principal: Principal, shared: str | None) -> bool:
        if not principal.role.allows(Role.operator):
            return False
        return principal.is_admin or principal.subject == sess.owner or shared == "control"

    def attach(
        self,
        sess: HubSession,
        principal: Principal,
        transport: ClientTransport,
        *,
        want_control: bool,
        may_control: bool,
        from_offset: int | None,
    ) -> AttachedClient:
        client = AttachedClient(
            self,
            sess,
            principal,
            transport,
            max_lag=self.settings.session_client_max_lag_bytes,
            frame_bytes=self.settings.session_frame_bytes,
        )
        client.may_control = may_control  # type: ignore[attr-defined]
        notice: str | None = None
        if want_control and not sess.ended:
            if not may_control:
                notice = proto.error(
                    "forbidden",
                    "you may only observe this session (control needs the operator role "
                    "and ownership)",
                )
            elif sess.controller is None:
                client.role = proto.ROLE_CONTROLLER
                sess.controller = client
            else:
                notice = proto.error(
                    "control-held",
                    f"{sess.controller.subject} has control; request_control with force takes it",
                )
        ring = sess.ring
        if from_offset is None:
            client.pending_resync = "initial"
        elif ring.start <= from_offset <= max(ring.end, sess.agent_end) or (
            from_offset > ring.end and not sess.synced and not sess.ended
        ):
            client.offset = from_offset
        else:
            client.pending_resync = "offset-unavailable"
        client.catchup_until = max(ring.end, sess.agent_end)
        sess.clients[client.id] = client
        hello = {
            "type": "hello",
            "protocol": proto.SUBPROTOCOL,
            "session": sess.id,
            "instance": sess.instance_id,
            "you": client.id,
            "role": client.role,
            "cols": sess.cols,
            "rows": sess.rows,
            "state": sess.state,
            "offset": {"start": ring.start, "end": ring.end},
            "from": client.offset if client.pending_resync is None else None,
            "members": sess.members(),
        }
        client.queue(proto.dumps(hello))
        if notice is not None:
            client.queue(notice)
        self._broadcast_members(sess, skip=client)
        self.events.publish(
            "session.attached",
            actor=principal.actor,
            instance_id=sess.instance_id,
            session_id=sess.id,
            owner=sess.owner,
            data={"client": client.id, "role": client.role},
        )
        return client

    def detach(self, client: AttachedClient) -> None:
        sess = client.session
        if sess.clients.pop(client.id, None) is None:
            return
        client.closed = True
        client.wake.set()
        if sess.controller is client:
            sess.controller = None
            self.events.publish(
                "session.control",
                actor=client.principal.actor,
                instance_id=sess.instance_id,
                session_id=sess.id,
                owner=sess.owner,
                data={"controller": None, "reason": "controller disconnected"},
            )
        self._broadcast_members(sess)
        self.events.publish(
            "session.detached",
            actor=client.principal.actor,
            instance_id=sess.instance_id,
            session_id=sess.id,
            owner=sess.owner,
            data={"client": client.id, "reason": client.close_reason or "closed"},
        )

    def _broadcast_members(self, sess: HubSession, skip: AttachedClient | None = None) -> None:
        msg = proto.dumps({"type": "members", "members": sess.members()})
        for c in sess.clients.values():
            if c is not skip:
                c.queue(msg)

    def _set_role(self, client: AttachedClient, role: str, reason: str) -> None:
        client.role = role
        client.queue(proto.dumps({"type": "role", "role": role, "reason": reason}))

    def request_control(self, client: AttachedClient, force: bool) -> None:
        sess = client.session
        if sess.ended:
            client.queue(proto.error("session-ended", "the session has ended"))
            return
        if sess.controller is client:
            self._set_role(client, proto.ROLE_CONTROLLER, "you already have control")
            return
        if not getattr(client, "may_control", False):
            client.queue(
                proto.error(
                    "forbidden",
                    "you may only observe this session (control needs the operator role and "
                    "ownership)",
                )
            )
            return
        previous = sess.controller
        if previous is not None and not force:
            client.queue(
                proto.error(
                    "control-held",
                    f"{previous.subject} has control; request_control with force takes it",
                )
            )
            return
        if previous is not None:
            self._set_role(
                previous, proto.ROLE_OBSERVER, f"control taken by {client.subject} (force)"
            )
            self.audit.record(
                client.principal.actor,
                "session.control.force",
                "session",
                sess.id,
                detail={"from": previous.principal.actor},
            )
        sess.controller = client
        self._set_role(
            client,
            proto.ROLE_CONTROLLER,
            "forced takeover" if previous is not None else "control was free",
        )
        self.events.publish(
            "session.control",
            actor=client.principal.actor,
            instance_id=sess.instance_id,
            session_id=sess.id,
            owner=sess.owner,
            data={
                "controller": client.subject,
                "client": client.id,
                "forced": previous is not None,
            },
        )
        self._broadcast_members(sess)

    def release_control(self, client: AttachedClient) -> None:
        sess = client.session
        if sess.controller is not client:
            client.queue(proto.error("not-controller", "you do not have control"))
            return
        sess.controller = None
        self._set_role(client, proto.ROLE_OBSERVER, "released")
        self.events.publish(
            "session.control",
            actor=client.principal.actor,
            instance_id=sess.instance_id,
            session_id=sess.id,
            owner=sess.owner,
            data={"controller": None, "reason": "released"},
        )
        self._broadcast_members(sess)

    def client_input(self, client: AttachedClient, data: bytes) -> None:
        sess = client.session
        if sess.controller is not client:
            client.queue(
                proto.error("not-controller", "observers cannot write; request_control first")
            )
            return
        if len(data) > proto.MAX_INPUT_BYTES:
            client.queue(
                proto.error(
                    "frame-too-large", f"input frames are at most {proto.MAX_INPUT_BYTES} bytes"
                )
            )
            return
        if sess.ended:
            client.queue(proto.error("session-ended", "the session has ended"))
            return
        if not data:
            return
        try:
            self._send_input(sess, data)
        except AgentUnavailable as exc:
            client.queue(proto.error("agent-unavailable", str(exc)))

    def client_resize(self, client: AttachedClient, cols: int, rows: int) -> None:
        sess = client.session
        if sess.controller is not client:
            client.queue(
                proto.error("not-controller", "only the controller resizes; the PTY has its size")
            )
            return
        if sess.ended:
            client.queue(proto.error("session-ended", "the session has ended"))
            return
        try:
            self.resize(sess, cols, rows)
        except AgentUnavailable as exc:
            client.queue(proto.error("agent-unavailable", str(exc)))

    def resize(self, sess: HubSession, cols: int, rows: int) -> None:
        if (cols, rows) == (sess.cols, sess.rows):
            return
        conn = self._link(sess.instance_id)
        try:
            conn.resize(sess.id, cols, rows)
        except LinkClosed as exc:
            raise AgentUnavailable(str(exc)) from None
        sess.cols, sess.rows = cols, rows
        if sess.screen is not None:
            sess.screen.catch_up(sess.ring)
            sess.screen.resize(cols, rows)
        if sess.recording is not None:
            sess.recording.resize(cols, rows)
        self._persist(sess.id, cols=cols, rows=rows)
        msg = proto.dumps({"type": "resize", "cols": cols, "rows": rows})
        for c in sess.clients.values():
            c.queue(msg)

    def client_signal(self, client: AttachedClient, name: SignalName) -> None:
        sess = client.session
        if sess.controller is not client:
            client.queue(proto.error("not-controller", "only the controller sends signals"))
            return
        if sess.ended:
            client.queue(proto.error("session-ended", "the session has ended"))
            return
        try:
            conn = self._link(sess.instance_id)
            conn.signal(sess.id, name)
        except (AgentUnavailable, LinkClosed) as exc:
            client.queue(proto.error("agent-unavailable", str(exc)))


HUB_KEY = web.AppKey("session_hub", SessionHub)
