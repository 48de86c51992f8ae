"""The session hub: PTY sessions on agents, multiplexed to any number of clients.

`SessionHub` is the coordinator: it implements `broker.sessions.contract.SessionService` (what
the task layer and the admin API use) and the agent link's `LinkHandler` (what agents report, in
typed values), and hands each concern to the module named for it:

    table.py         the sessions held, by id (and the gauges read from them)
    session.py       one session: identity, state, ring, screen, clients (`HubSession`)
    states.py        the states (`SessionState`)
    lifecycle.py     transitions: opened, kill requested, ended (audited, published, counted)
    output.py        the output pipeline: redaction → ring → recording → quiet timer → HITL
    reconcile.py     (re)registration: resume points, lost sessions, adoption within the cap
    trust.py         nothing an agent reports is trusted: ownership, ids, bounds, refusals
    commands.py      input, resize, signal, close to the agent (one map to AgentUnavailable)
    control.py       attached clients and the controller lease
    housekeeping.py  the periodic sweep: recordings, stuck clients, offsets, secrets, eviction
    rows.py          the row write-behind
    recordings.py    recording files: names from ids, created exclusively

Output arrives once from the agent link (`on_output`), continues the stream at the offset the
hub expects (duplicates dropped, gaps noted) and enters the pipeline; clients and followers are
woken, never waited for. Input goes the other way at once (no batching).

Persistence: a session row is written when it is created; state changes and offsets go through
the write-behind, so the output path never waits for the database. After a server restart the
hub loads every unfinished session and reconciles when its agent registers again, so a client
reattaching with `from=<offset>` continues byte-exactly.

Everything an agent reports is untrusted (`trust.py`): a message for a session of another
instance or incarnation, one the hub does not hold, or with a malformed id, is dropped (the first
few per link are logged, all are counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from sqlalchemy import insert, select

from agentic_sandbox.broker.agentlink import (
    SIGNAL_NAMES,
    AgentConnection,
    Exited,
    Inventory,
    LinkClosed,
    Opened,
    OpenRequest,
    Output,
    Reconciled,
    SignalName,
)
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.commands import AgentCommands, closed_is_unavailable
from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    BudgetSupport,
    ExitStatus,
    OutputChunk,
    PromptListener,
    SessionEnded,
    SessionError,
    SessionNotFound,
    SessionSpec,
)
from agentic_sandbox.broker.sessions.control import ControlArbiter
from agentic_sandbox.broker.sessions.housekeeping import Housekeeping
from agentic_sandbox.broker.sessions.lifecycle import Lifecycle
from agentic_sandbox.broker.sessions.output import OutputPipeline
from agentic_sandbox.broker.sessions.reconcile import Reconciler
from agentic_sandbox.broker.sessions.recordings import RecordingStore
from agentic_sandbox.broker.sessions.ring import OutputRing
from agentic_sandbox.broker.sessions.rows import SESSIONS, SessionRows
from agentic_sandbox.broker.sessions.screen import ScreenTracker
from agentic_sandbox.broker.sessions.session import Follower, HubSession
from agentic_sandbox.broker.sessions.states import ENDED, LIVE, SessionState
from agentic_sandbox.broker.sessions.table import SessionTable
from agentic_sandbox.broker.sessions.trust import (
    EXIT_REASON_CHARS,
    MAX_OFFSET,
    AgentTrust,
    belongs,
    exit_status,
)
from agentic_sandbox.broker.store import models as m

if TYPE_CHECKING:
    from agentic_sandbox.broker.agentlink import AgentRegistry
    from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

INSERT_SESSION = insert(SESSIONS)

FOLLOW_CHUNK = 256 * 1024
_SIGNALS: dict[str, SignalName] = {name: name for name in SIGNAL_NAMES}


class TooManySessions(SessionError):
    """The instance has as many live sessions as the server allows."""


class SessionStartFailed(SessionError):
    """The agent could not start the command (not found, bad cwd or user, …)."""


class SessionOpenTimeout(SessionError):
    """The agent did not answer the open request in time."""


class SessionHub:
    """The server's `SessionService`, and the agent link's `LinkHandler`."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.db = svc.db
        self._events = svc.events
        self._audit = svc.audit
        self._sessions = SessionTable(svc.metrics)
        self.recordings = RecordingStore(svc.settings)
        self.rows = SessionRows(svc.db)
        svc.writers.append(self.rows.writer)  # its backlog and drops are metrics too
        self.output = OutputPipeline(svc.settings, svc.metrics, svc.events)
        self.lifecycle = Lifecycle(svc.metrics, svc.events, svc.audit, self.rows, self.output)
        self.commands = AgentCommands(svc.settings, svc.metrics, self.rows)
        self.control = ControlArbiter(
            svc.settings, svc.metrics, svc.events, svc.audit, self.commands
        )
        self.trust = AgentTrust(self._sessions, svc.metrics)
        self.reconciler = Reconciler(
            svc.settings,
            svc.db,
            svc.metrics,
            svc.events,
            self._sessions,
            self.trust,
            self.lifecycle,
            self.output,
            self.recordings,
            self._secrets,
        )
        self.housekeeping = Housekeeping(
            svc.settings,
            svc.metrics,
            self._sessions,
            self.rows,
            self.output,
            self.control,
            self._secrets,
        )
        self._sweep: asyncio.Task[None] | None = None

    # ========================================================================= start and stop
    def use_registry(self, registry: AgentRegistry) -> None:
        self.commands.use_registry(registry)

    async def start(self) -> None:
        self.output.start()
        self.recordings.prepare()
        async with self.db.session() as s:
            rows = (await s.scalars(select(m.Session).where(m.Session.state.in_(LIVE)))).all()
        for row in rows:
            self.reconciler.load(row)
        if rows:
            log.info("loaded %d unfinished sessions; waiting for their agents", len(rows))
        self.rows.start()
        self._sweep = asyncio.create_task(self.housekeeping.run(), name="session-housekeeping")

    async def stop(self) -> None:
        for sess in self._sessions.all():
            for client in list(sess.clients.values()):
                client.queue(proto.error("server-shutdown", "the server is shutting down"))
                client.kick("server shutting down")
            for follower in sess.followers:
                follower.wake.set()
            sess.flush_recording()
            if sess.ring.end != sess.persisted_offset:
                self.rows.persist(sess.id, output_offset=sess.ring.end)
        await asyncio.sleep(0)
        if self._sweep is not None:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sweep
        await self.rows.stop()
        for sess in self._sessions:
            sess.close_recording()

    # ============================================================================== queries
    def get(self, session_id: str) -> HubSession | None:
        return self._sessions.get(session_id)

    def sessions(self) -> list[HubSession]:
        return self._sessions.all()

    def screen(self, sess: HubSession) -> ScreenTracker:
        return sess.current_screen()

    def recording_file(self, session_id: str) -> Path | None:
        """The recording file of a session: derived from the id, never from a stored path."""
        return self.recordings.file(session_id)

    def _require(self, session_id: str) -> HubSession:
        sess = self._sessions.get(session_id)
        if sess is None:
            raise SessionNotFound(session_id)
        return sess

    async def _secrets(self, instance_id: str) -> dict[str, str]:
        try:
            return await self.svc.vault.values_for_instance(instance_id)
        except Exception:
            log.exception("reading secrets of %s failed; none are passed or redacted", instance_id)
            return {}

    # ============================================================================= contract
    def agent_ready(self, instance_id: str) -> bool:
        return self.commands.ready(instance_id)

    def budget_support(self, instance_id: str) -> BudgetSupport | None:
        conn = self.commands.current(instance_id)
        if conn is None or not conn.ready:
            return None
        info = conn.info
        return BudgetSupport(info.budget_enforcement, info.budgets, info.budget_problem)

    async def create(self, spec: SessionSpec, *, actor: str) -> str:
        conn = self.commands.link(spec.instance_id)
        if spec.make_dirs and not conn.info.session_dirs:  # it would ignore them: refused here
            raise SessionStartFailed(
                f"the agent of instance {spec.instance_id!r} does not make a session's "
                f"directories (agent version {conn.info.agent_version or 'unknown'})"
            )
        live = self._sessions.live_count(spec.instance_id)
        if live >= self.settings.session_max_per_instance:
            raise TooManySessions(
                f"instance {spec.instance_id!r} has {live} live sessions (the limit)"
            )
        cols = max(1, min(proto.MAX_COLS, spec.cols))
        rows = max(1, min(proto.MAX_ROWS, spec.rows))
        secrets_env = await self._secrets(spec.instance_id)
        sess = self._new_session(spec, conn.incarnation, cols, rows)
        sess.redactor.set(secrets_env.values())
        # a Core insert on a connection: the ORM's unit of work cost more than the statement
        async with self.db.begin() as db:
            await db.execute(
                INSERT_SESSION,
                {
                    "id": sess.id,
                    "instance_id": spec.instance_id,
                    "incarnation": conn.incarnation,
                    "owner": spec.owner,
                    "name": spec.name,
                    "command": sess.command,
                    "cols": cols,
                    "rows": rows,
                    "cwd": spec.cwd,
                    "user": spec.user,
                    "env": dict(spec.env),  # never the secrets
                    "state": SessionState.starting.value,
                    "task_id": spec.task_id,
                    "recording_path": sess.recording_path,
                    "created_at": sess.created_at,
                },
            )
        self._sessions.add(sess)
        sess.opening = asyncio.get_running_loop().create_future()
        request = OpenRequest(
            session_id=sess.id,
            command=sess.command or [],
            cols=cols,
            rows=rows,
            env={**secrets_env, **spec.env},
            cwd=spec.cwd or "",
            user=spec.user or "",
            task_id=spec.task_id or "",
            budget=spec.budget,
            make_dirs=spec.make_dirs,
            list_on_exit=spec.list_on_exit,
        )
        try:
            with closed_is_unavailable:
                conn.open_session(request)  # the link the session's incarnation was taken from
            async with asyncio.timeout(self.settings.session_open_timeout_seconds):
                opened = await asyncio.shield(sess.opening)
        except AgentUnavailable as exc:
            self.lifecycle.open_failed(sess, f"agent link lost while opening: {exc}", actor=actor)
            raise AgentUnavailable(str(exc)) from None
        except TimeoutError:
            self.lifecycle.open_failed(sess, "the agent did not answer in time", actor=actor)
            raise SessionOpenTimeout("the agent did not open the session in time") from None
        finally:
            sess.opening = None
        if not opened.ok:
            self.lifecycle.open_failed(
                sess, opened.error or "the agent could not start the command", actor=actor
            )
            raise SessionStartFailed(f"the agent could not start the session: {opened.error}")
        self.lifecycle.opened(sess, actor=actor, pid=opened.pid, cols=cols, rows=rows)
        return sess.id

    def _new_session(self, spec: SessionSpec, incarnation: str, cols: int, rows: int) -> HubSession:
        """A session the server makes: a fresh id, an empty ring, a new recording (if on)."""
        sess = HubSession(
            id=str(uuid.uuid4()),
            instance_id=spec.instance_id,
            owner=spec.owner,
            name=spec.name,
            command=list(spec.command) if spec.command else None,
            cols=cols,
            rows=rows,
            created_at=dt.datetime.now(dt.UTC),
            ring=OutputRing(self.settings.session_ring_bytes),
            incarnation=incarnation,
            task_id=spec.task_id,
            cwd=spec.cwd,
            user=spec.user,
            lists_on_exit=bool(spec.list_on_exit),
        )
        if self.recordings.enabled:
            sess.recording = self.recordings.create(
                sess.id,
                cols=cols,
                rows=rows,
                title=spec.name,
                command=sess.command,
                started_wall=sess.created_at.timestamp(),
            )
            sess.recording_path = str(sess.recording.path)
        return sess

    async def write(self, session_id: str, data: bytes, *, actor: str) -> None:
        sess = self._require(session_id)
        if sess.ended:
            raise SessionEnded(session_id)
        self.commands.send_input(sess, data)

    async def signal(self, session_id: str, signal: str, *, actor: str) -> None:
        sess = self._require(session_id)
        if sess.ended:
            raise SessionEnded(session_id)
        name = _SIGNALS.get(signal.upper().removeprefix("SIG"))
        if name is None:
            raise SessionError(f"unknown signal {signal!r}; use INT, TERM, KILL or HUP")
        self.commands.signal(sess, name)
        self._audit.record(
            actor, "session.signal", "session", sess.id, detail={"signal": signal.upper()}
        )

    async def kill(self, session_id: str, *, actor: str) -> None:
        sess = self._require(session_id)
        if sess.ended:
            return
        self.lifecycle.kill_requested(sess, actor=actor)
        self.commands.kill(sess)  # without a link: the agent is told when it registers again

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
                if not self._sessions.holds(sess):
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
            lost=row.state == SessionState.lost,
            reason=row.exit_reason,
        )

    async def end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's sessions end at once (lost: the instance is gone); their
        clients are told, get the exit and are closed by their writers (input is refused from
        now on), their followers (task runs) see the end."""
        for sess in self._sessions.of_instance(ended.instance_id):
            if sess.ended or sess.incarnation not in (None, ended.incarnation):
                continue
            for client in list(sess.clients.values()):
                client.queue(proto.error("instance-deleted", "the instance was deleted"))
            self.lifecycle.end(
                sess,
                SessionState.lost,
                ExitStatus(code=None, lost=True, reason=f"the instance ended: {ended.reason}"),
                actor=ended.actor,
            )

    def add_prompt_listener(self, listener: PromptListener) -> None:
        self.output.add_prompt_listener(listener)

    # ========================================================================== link handler
    async def on_register(self, conn: AgentConnection, inventory: list[Inventory]) -> Reconciled:
        return await self.reconciler.reconcile(conn, inventory)

    def on_output(self, conn: AgentConnection, output: Output) -> None:
        sess = self._sessions.get(output.session_id)
        if sess is None or not belongs(sess, conn):
            self.trust.mine(conn, output.session_id, "output")
            return
        data = output.data
        offset = output.offset
        end = sess.recv_end
        n = len(data)
        if offset + n <= end:
            return  # already have it
        if offset + n > MAX_OFFSET:
            self.trust.refuse(conn, "output", "bad-offset", sess.id)
            return
        if offset < end:
            data = data[end - offset :]
            offset = end
        elif offset > end:
            self.output.gap(sess, end, offset)
        sess.recv_end = offset + len(data)
        self.output.feed(sess, data)
        conn.ack(sess.id, sess.ring.end)

    def on_opened(self, conn: AgentConnection, opened: Opened) -> None:
        sess = self.trust.mine(conn, opened.session_id, "opened")
        if sess is None:
            return
        if sess.opening is not None and not sess.opening.done():
            opened.error = opened.error[:EXIT_REASON_CHARS]
            sess.opening.set_result(opened)

    def on_exit(self, conn: AgentConnection, exited: Exited) -> None:
        sess = self.trust.mine(conn, exited.session_id, "exit")
        if sess is None:
            return
        if not sess.ended:
            if exited.end_offset > sess.recv_end:
                log.warning(
                    "session %s exited with output %d..%d missing",
                    sess.id,
                    sess.recv_end,
                    min(exited.end_offset, MAX_OFFSET),
                )
            report = exited.exit
            if not sess.lists_on_exit:
                report.listing = None  # not asked for: not kept with the ended session
            failed = bool(report.error) and report.code is None and not report.signal
            self.lifecycle.end(
                sess,
                SessionState.failed if failed else SessionState.exited,
                exit_status(report),
                actor=f"agent:{conn.instance_id}",
            )
        conn.forget_session(sess.id)
        with contextlib.suppress(LinkClosed):
            conn.close_session(sess.id)

    def on_disconnect(self, conn: AgentConnection) -> None:
        self.trust.forget(conn)
        current = self.commands.current(conn.instance_id)
        if current is not None and current is not conn:
            return  # replaced by a newer link, which has registered already
        for sess in self._sessions.of_instance(conn.instance_id):
            if sess.ended:
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


HUB_KEY = web.AppKey("session_hub", SessionHub)
