"""Reconciliation with an agent on every (re)registration, and the sessions a restart reloads.

After a server restart the hub loads every unfinished session (`load`): their rings are empty
and not `synced` until their agent registers. When an agent registers, its inventory (what it
holds: per session its ring start, output end, size, state) is compared with what the hub holds
for that agent's instance *and* incarnation (`reconcile`):

- known and held by the agent: kept; its output resumes where the server's ring ends (a link
  drop), or, after a restart (empty ring), at `max(agent ring start, agent end - ring
  capacity)`, so the new ring holds as much history as the agent still has;
- known but gone from the agent: `lost`;
- held by the agent but unknown: adopted (a row owned by the instance's owner,
  `session.adopted`) while the instance has fewer live sessions than the per-instance cap; the
  rest are told to end — as is one the server knows has ended, or that is another instance's
  (held, or stored) or an earlier incarnation's;
- a kill requested while the agent was away: told to end.

Nothing in an inventory is trusted (`trust.py`): a malformed id is dropped, never looked up or
echoed back; impossible offsets end that session; a claimed `task_id` is kept only when it
names a task of the same instance; sizes are clamped; at most `MAX_CLOSE_REPLIES` sessions are
told to end in one answer.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from sqlalchemy import select

from agentic_sandbox.broker.agentlink import AgentConnection, Inventory, Reconciled, Resume
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions.contract import ExitStatus
from agentic_sandbox.broker.sessions.ids import is_session_id
from agentic_sandbox.broker.sessions.lifecycle import Lifecycle
from agentic_sandbox.broker.sessions.output import OutputPipeline
from agentic_sandbox.broker.sessions.recordings import RecordingStore
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.broker.sessions.states import ENDED, SessionState
from agentic_sandbox.broker.sessions.table import SessionTable
from agentic_sandbox.broker.sessions.trust import (
    AgentTrust,
    belongs,
    bounded_size,
    inventory_ok,
)
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

MAX_CLOSE_REPLIES = 10_000  # sessions a registration answer tells the agent to end, at most
ID_LOOKUP_BATCH = 500

SecretsOf = Callable[[str], Awaitable[dict[str, str]]]


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        metrics: Metrics,
        events: EventBus,
        table: SessionTable,
        trust: AgentTrust,
        lifecycle: Lifecycle,
        output: OutputPipeline,
        recordings: RecordingStore,
        secrets_of: SecretsOf,
    ) -> None:
        self._ring_bytes = settings.session_ring_bytes
        self._max_per_instance = settings.session_max_per_instance
        self._db = db
        self._opened = metrics.sessions_opened
        self._events = events
        self._table = table
        self._trust = trust
        self._lifecycle = lifecycle
        self._output = output
        self._recordings = recordings
        self._secrets_of = secrets_of

    def load(self, row: m.Session) -> HubSession:
        """Hold a stored session again (its recording resumed), not synced with its agent."""
        sess = HubSession.from_row(row, self._ring_bytes)
        sess.recording = self._recordings.resume(row)
        sess.synced = False
        self._table.add(sess)
        return sess

    async def reconcile(self, conn: AgentConnection, inventory: Sequence[Inventory]) -> Reconciled:
        """The answer to a registration: what to keep (and where its output resumes), what to
        end. Marks lost what the agent no longer has; adopts what it has and the server lost."""
        refused: Counter[str] = Counter()
        held: dict[str, Inventory] = {}
        impossible: set[str] = set()  # well-formed ids whose report cannot be true
        for item in inventory:
            if not is_session_id(item.session_id):
                refused["bad-id"] += 1  # never looked up, stored or echoed back
            elif not inventory_ok(item):
                refused["bad-inventory"] += 1
                impossible.add(item.session_id)
            else:
                held[item.session_id] = item
        for sid in impossible & held.keys():  # one impossible report for an id is enough
            del held[sid]
        answer = Reconciled()
        close = answer.close
        actor = f"agent:{conn.instance_id}"
        for sess in self._table.of_instance(conn.instance_id):
            if not belongs(sess, conn):
                continue  # an earlier instance's with this id: never this agent's
            inv = held.pop(sess.id, None)
            bad = sess.id in impossible
            impossible.discard(sess.id)
            if sess.ended:
                if inv is not None or bad:
                    close.append(sess.id)
                continue
            if inv is None:
                if bad:
                    close.append(sess.id)
                self._lifecycle.end(
                    sess,
                    SessionState.lost,
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
            answer.resume.append(Resume(sess.id, self._resume_point(sess, inv)))
            if sess.kill_requested:
                close.append(sess.id)
        close.extend(impossible)  # unknown to this instance: end them
        if held:
            await self._adopt(conn, held, answer, refused)
        if len(close) > MAX_CLOSE_REPLIES:
            refused["unanswered"] += len(close) - MAX_CLOSE_REPLIES
            del close[MAX_CLOSE_REPLIES:]
        self._trust.refused_in_registration(conn, refused)
        if answer.resume or close:
            log.info(
                "agent %s registered: %d sessions resumed, %d to end",
                conn.instance_id,
                len(answer.resume),
                len(close),
                extra={"instance_id": conn.instance_id},
            )
        return answer

    def _resume_point(self, sess: HubSession, inv: Inventory) -> int:
        """Where the session's output resumes; brings the ring, the clients' catch-up bound,
        the size and the state in line with the agent's report."""
        ring = sess.ring
        # After a restart the ring is empty: refill it with the most the agent still holds.
        frm = ring.end if sess.synced else max(inv.ring_start, inv.end_offset - ring.capacity)
        frm = max(frm, inv.ring_start)
        frm = min(frm, inv.end_offset)
        sess.agent_end = inv.end_offset
        if frm != ring.end or not sess.synced:
            if frm != ring.end:
                dropped = sess.redactor.drop_held()
                if dropped:
                    log.debug("session %s: dropped %d held bytes at resync", sess.id, dropped)
                ring.reset(frm)
                if sess.screen is not None:
                    sess.screen.offset = -1
            sess.recv_end = frm
        sess.synced = True
        for client in sess.clients.values():
            client.catchup_until = max(client.catchup_until, inv.end_offset)
        cols, rows = bounded_size(inv.cols, inv.rows)
        if cols and rows and (cols, rows) != (sess.cols, sess.rows):
            sess.cols, sess.rows = cols, rows
            if sess.screen is not None:
                sess.screen.resize(cols, rows)
        if sess.state == SessionState.starting and inv.running:
            self._lifecycle.move(sess, SessionState.running)
        sess.notify()
        return frm

    async def _adopt(
        self,
        conn: AgentConnection,
        unknown: dict[str, Inventory],
        answer: Reconciled,
        refused: Counter[str],
    ) -> None:
        """Sessions the agent holds that this instance's hub does not: adopt them while the
        instance is under its session limit; end the rest, and any that is another instance's
        or has ended."""
        iid = conn.instance_id
        close = answer.close
        room = self._max_per_instance - self._table.live_count(iid)
        pending: list[tuple[str, Inventory]] = []
        for sid, inv in unknown.items():
            if sid in self._table:  # held for another instance (this one's matched above)
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
            async with self._db.session() as s:
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
        secrets = (await self._secrets_of(iid)).values()
        for row, inv in known_rows:
            sess = self.load(row)
            self._output.set_secrets(sess, secrets)
            answer.resume.append(Resume(row.id, self._resume_point(sess, inv)))

    async def _adopt_rows(
        self, conn: AgentConnection, new: list[tuple[str, Inventory]]
    ) -> list[tuple[m.Session, Inventory]]:
        """Rows (and recordings) for sessions the server lost track of (e.g. its database was
        reset), owned by the instance's owner."""
        iid = conn.instance_id
        claimed = {inv.task_id for _, inv in new if is_session_id(inv.task_id)}
        tasks: set[str] = set()
        if claimed:  # a task id is kept only when it names a task of this instance
            async with self._db.session() as s:
                tasks = set(
                    await s.scalars(
                        select(m.Task.id).where(m.Task.id.in_(claimed), m.Task.instance_id == iid)
                    )
                )
        now = dt.datetime.now(dt.UTC)
        rows: list[tuple[m.Session, Inventory]] = []
        for sid, inv in new:
            cols, rows_ = bounded_size(inv.cols, inv.rows)
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
                state=SessionState.running.value,
                task_id=inv.task_id if inv.task_id in tasks else None,
                output_offset=inv.ring_start,
                created_at=now,
            )
            if self._recordings.enabled:
                row.recording_path = self._recordings.create_adopted(row, inv.ring_start)
            rows.append((row, inv))
        try:
            async with self._db.session() as s:
                s.add_all([row for row, _ in rows])
        except BaseException:
            for row, _ in rows:
                if row.recording_path:
                    self._recordings.discard(Path(row.recording_path))
            raise
        for row, _ in rows:
            self._opened.labels("adopted").inc()
            self._events.publish(
                "session.adopted",
                actor=f"agent:{iid}",
                instance_id=iid,
                session_id=row.id,
                task_id=row.task_id,
                owner=conn.owner,
                data={"reason": "the agent had a session the server did not know"},
            )
        return rows
