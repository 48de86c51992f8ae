"""Persistence of tasks, runs, task events, push configs and idempotency keys (SQLAlchemy).

Only `machine.TaskMachine` writes a task's state (compare-and-set on `version`); everything
else here is rows the task layer reads or appends.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime as dt
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import (
    Integer,
    String,
    Table,
    and_,
    bindparam,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.dml import Insert, Update

from agentic_sandbox.broker.http.body import decode_json
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks.errors import InvalidTaskInput
from agentic_sandbox.broker.tasks.record import TaskRecord
from agentic_sandbox.broker.tasks.states import TaskState

ACTIVE_RUN_STATES = ("starting", "running")
TASKS = cast(Table, m.Task.__table__)
RUNS = cast(Table, m.Run.__table__)
EVENTS = cast(Table, m.TaskEvent.__table__)
IDEM = cast(Table, m.IdempotencyKey.__table__)


@dataclass(frozen=True)
class TaskFilter:
    instance_id: str | None = None
    incarnation: str | None = None  # only tasks sent to this incarnation of the instance
    owner: str | None = None  # None: every owner (admins)
    context_id: str | None = None
    states: tuple[TaskState, ...] = ()
    status_after: dt.datetime | None = None


@dataclass
class Page:
    rows: list[m.Task]
    next_token: str
    total: int


@dataclass
class EventRow:
    seq: int
    kind: str  # status | output
    payload: dict[str, Any]
    created_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    sealed: bool = False  # being written: later output starts a new row


def encode_cursor(updated_at: dt.datetime, task_id: str) -> str:
    raw = json.dumps([updated_at.isoformat(), task_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(token: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        doc = decode_json(raw)  # a client's token: untrusted JSON
        if not isinstance(doc, list) or len(doc) != 2:
            raise ValueError("bad cursor")
        when, task_id = doc
        if not isinstance(when, str) or not isinstance(task_id, str):
            raise ValueError("bad cursor")
        stamp = dt.datetime.fromisoformat(when)
        if stamp.tzinfo is None:
            raise ValueError("bad cursor")
        return stamp, task_id
    except (ValueError, TypeError, binascii.Error):
        raise InvalidTaskInput(
            "pageToken is not a token this server handed out", field="pageToken"
        ) from None


class _LostRace(Exception):
    pass


class TaskStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        # On SQLite (one writer at a time anyway) the hot-path writes share one held
        # connection, taken in turn: no pool checkout or liveness ping per transaction, and no
        # busy-waiting against ourselves. PostgreSQL uses the pool.
        self._serial = db.dialect == "sqlite"
        self._conn: AsyncConnection | None = None
        self._lock = asyncio.Lock()

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction (committed on exit, rolled back on an exception)."""
        if not self._serial:
            async with self.db.begin() as conn:
                yield conn
            return
        async with self._lock:
            if self._conn is None:
                self._conn = await self.db.engine.connect()
            conn = self._conn
            try:
                async with conn.begin():
                    yield conn
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    self._conn = None
                raise

    async def close(self) -> None:
        async with self._lock:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None

    # ---- tasks ----------------------------------------------------------------------------
    async def insert(
        self,
        record: TaskRecord,
        first_event: EventRow,
        *,
        idempotency: tuple[str, str, str] | None = None,
        claim: Claim | None = None,
    ) -> tuple[tuple[str, str] | None, bool]:
        """Insert a new task with its first status event (and its idempotency key), and try to
        claim its run in the same transaction.

        Returns (None, claimed) on success, or ((request hash, task id) already recorded for
        the idempotency key, False) — nothing is written then.
        """
        values = {
            "id": record.id,
            "instance_id": record.instance_id,
            "incarnation": record.incarnation,
            "owner": record.owner,
            "context_id": record.context_id,
            "state": record.state.value,
            "skill": record.skill,
            "message_id": record.message_id,
            "status_message": record.status_message,
            "history": record.history,
            "artifacts": [],
            "metadata": record.metadata,
            "version": record.version,
            "created_at": record.created_at,
            "updated_at": record.updated_at,
            "status_at": record.status_at,
        }
        try:
            async with self._write() as conn:
                if idempotency is not None:
                    scope, key, digest = idempotency
                    await conn.execute(
                        INSERT_IDEM,
                        {
                            "scope": scope,
                            "key": key,
                            "request_hash": digest,
                            "result_id": record.id,
                            "created_at": record.created_at,
                        },
                    )
                await conn.execute(INSERT_TASK, values)
                await conn.execute(INSERT_EVENT, _event_values(record.id, first_event))
                claimed = False
                if claim is not None:
                    result = await conn.execute(CLAIM_RUN, _claim_params(claim))
                    claimed = result.rowcount == 1
        except IntegrityError:
            if idempotency is None:
                raise
            found = await self.idempotent_result(idempotency[0], idempotency[1])
            if found is None:
                raise
            return found, False
        return None, claimed

    async def idempotent_result(self, scope: str, key: str) -> tuple[str, str] | None:
        """(request_hash, task id) recorded for this key, if any."""
        async with self.db.session() as s:
            row = await s.get(m.IdempotencyKey, (scope, key))
            return None if row is None else (row.request_hash, row.result_id)

    async def remember_key(self, scope: str, key: str, digest: str, task_id: str) -> bool:
        """Record an idempotency key for a follow-up message; False if it already exists."""
        try:
            async with self.db.session() as s:
                s.add(
                    m.IdempotencyKey(scope=scope, key=key, request_hash=digest, result_id=task_id)
                )
        except IntegrityError:
            return False
        return True

    async def get(self, task_id: str) -> m.Task | None:
        async with self.db.session() as s:
            return await s.get(m.Task, task_id)

    async def write_transition(
        self,
        record: TaskRecord,
        expected_version: int,
        events: Sequence[EventRow],
        *,
        artifacts: list[dict[str, Any]] | None,
        run_id: str | None = None,
        run_values: dict[str, Any] | None = None,
    ) -> bool:
        """Compare-and-set the task row (by version) plus its new events and run; False on a
        lost race (another writer changed the task first)."""
        values: dict[str, Any] = {
            "state": record.state.value,
            "status_message": record.status_message,
            "history": record.history,
            "metadata": record.metadata,
            "version": record.version,
            "updated_at": record.updated_at,
            "status_at": record.status_at,
        }
        if artifacts is not None:
            values["artifacts"] = artifacts
        try:
            async with self._write() as conn:
                result = await conn.execute(
                    UPDATE_TASK if artifacts is None else UPDATE_TASK_ARTIFACTS,
                    {**values, "_id": record.id, "_version": expected_version},
                )
                if result.rowcount != 1:
                    raise _LostRace
                if events:
                    rows = [_event_values(record.id, ev) for ev in events]
                    await conn.execute(INSERT_EVENT, rows)
                if run_id is not None and run_values:
                    await conn.execute(update(RUNS).where(RUNS.c.id == run_id).values(**run_values))
        except _LostRace:
            return False
        return True

    async def append_output(
        self,
        task_id: str,
        events: Sequence[EventRow],
        *,
        updated_at: dt.datetime,
        run_id: str | None,
        offset: int | None,
    ) -> None:
        """Persist output chunks and the run offset they reach, in one transaction."""
        async with self._write() as conn:
            if events:
                await conn.execute(INSERT_EVENT, [_event_values(task_id, ev) for ev in events])
            await conn.execute(
                update(TASKS).where(TASKS.c.id == task_id).values(updated_at=updated_at)
            )
            if run_id is not None and offset is not None:
                await conn.execute(
                    update(RUNS).where(RUNS.c.id == run_id).values(output_bytes=offset)
                )

    async def output_text(self, task_id: str) -> tuple[str, int]:
        """The persisted output of a task that has not ended yet, and its last event seq."""
        async with self.db.session() as s:
            rows = (
                await s.execute(
                    select(m.TaskEvent.kind, m.TaskEvent.payload, m.TaskEvent.seq)
                    .where(m.TaskEvent.task_id == task_id)
                    .order_by(m.TaskEvent.seq)
                )
            ).all()
        text = "".join(p.get("text", "") for kind, p, _ in rows if kind == "output")
        return text, (rows[-1][2] if rows else 0)

    async def events(self, task_id: str) -> list[m.TaskEvent]:
        async with self.db.session() as s:
            return list(
                (
                    await s.scalars(
                        select(m.TaskEvent)
                        .where(m.TaskEvent.task_id == task_id)
                        .order_by(m.TaskEvent.seq)
                    )
                ).all()
            )

    async def unfinished(self) -> list[m.Task]:
        """Tasks that have not reached a terminal state (recovery after a restart)."""
        open_states = [s.value for s in TaskState if not s.terminal]
        async with self.db.session() as s:
            return list(
                (
                    await s.scalars(
                        select(m.Task)
                        .where(m.Task.state.in_(open_states))
                        .order_by(m.Task.created_at)
                    )
                ).all()
            )

    async def page(self, flt: TaskFilter, *, page_size: int, page_token: str = "") -> Page:
        conds = _filter_conditions(flt)
        stmt = select(m.Task).where(*conds)
        if page_token:
            when, tid = decode_cursor(page_token)
            stmt = stmt.where(
                or_(m.Task.updated_at < when, and_(m.Task.updated_at == when, m.Task.id < tid))
            )
        stmt = stmt.order_by(m.Task.updated_at.desc(), m.Task.id.desc()).limit(page_size + 1)
        async with self.db.session() as s:
            rows = list((await s.scalars(stmt)).all())
            total = int(await s.scalar(select(func.count()).select_from(m.Task).where(*conds)) or 0)
        token = ""
        if len(rows) > page_size:
            rows = rows[:page_size]
            token = encode_cursor(rows[-1].updated_at, rows[-1].id)
        return Page(rows=rows, next_token=token, total=total)

    async def count_by_state(self, flt: TaskFilter) -> dict[str, int]:
        conds = _filter_conditions(flt)
        async with self.db.session() as s:
            rows = (
                await s.execute(
                    select(m.Task.state, func.count()).where(*conds).group_by(m.Task.state)
                )
            ).all()
        return {state: int(n) for state, n in rows}

    # ---- runs -----------------------------------------------------------------------------
    async def claim_run(self, claim: Claim) -> bool:
        """Atomically insert a `starting` run if the concurrency quotas allow it."""
        async with self._write() as conn:
            result = await conn.execute(CLAIM_RUN, _claim_params(claim))
            return bool(result.rowcount == 1)

    async def update_run(self, run_id: str, **values: Any) -> None:
        async with self._write() as conn:
            await conn.execute(update(RUNS).where(RUNS.c.id == run_id).values(**values))

    async def active_run(self, task_id: str) -> m.Run | None:
        async with self.db.session() as s:
            return await s.scalar(
                select(m.Run)
                .where(m.Run.task_id == task_id, m.Run.state.in_(ACTIVE_RUN_STATES))
                .order_by(m.Run.attempt.desc())
                .limit(1)
            )

    async def open_session_of(self, task_id: str) -> str | None:
        """The session a task's run opened that has not ended (the newest), if any."""
        async with self.db.session() as s:
            return await s.scalar(
                select(m.Session.id)
                .where(m.Session.task_id == task_id, m.Session.ended_at.is_(None))
                .order_by(m.Session.created_at.desc())
                .limit(1)
            )

    async def runs(self, task_id: str) -> list[m.Run]:
        async with self.db.session() as s:
            return list(
                (
                    await s.scalars(
                        select(m.Run).where(m.Run.task_id == task_id).order_by(m.Run.attempt)
                    )
                ).all()
            )

    async def active_run_counts(self) -> tuple[int, dict[str, int]]:
        async with self.db.session() as s:
            rows = (
                await s.execute(
                    select(m.Task.owner, func.count())
                    .select_from(m.Run)
                    .join(m.Task, m.Task.id == m.Run.task_id)
                    .where(m.Run.state.in_(ACTIVE_RUN_STATES))
                    .group_by(m.Task.owner)
                )
            ).all()
        per_owner = {owner: int(n) for owner, n in rows}
        return sum(per_owner.values()), per_owner

    # ---- push configs ---------------------------------------------------------------------
    async def put_push_config(self, row: m.PushConfig) -> None:
        async with self.db.session() as s:
            await s.merge(row)

    async def push_configs(self, task_id: str | None = None) -> list[m.PushConfig]:
        stmt = select(m.PushConfig).order_by(m.PushConfig.created_at, m.PushConfig.id)
        if task_id is not None:
            stmt = stmt.where(m.PushConfig.task_id == task_id)
        async with self.db.session() as s:
            return list((await s.scalars(stmt)).all())

    async def push_configs_for_open_tasks(self) -> list[m.PushConfig]:
        open_states = [s.value for s in TaskState if not s.terminal]
        async with self.db.session() as s:
            return list(
                (
                    await s.scalars(
                        select(m.PushConfig)
                        .join(m.Task, m.Task.id == m.PushConfig.task_id)
                        .where(m.Task.state.in_(open_states))
                    )
                ).all()
            )

    async def get_push_config(self, task_id: str, config_id: str) -> m.PushConfig | None:
        async with self.db.session() as s:
            return await s.get(m.PushConfig, (task_id, config_id))

    async def delete_push_config(self, task_id: str, config_id: str) -> bool:
        async with self.db.session() as s:
            row = await s.get(m.PushConfig, (task_id, config_id))
            if row is None:
                return False
            await s.delete(row)
            return True


@dataclass(frozen=True)
class Claim:
    """A run to claim for a task, within the concurrency quotas."""

    task_id: str
    owner: str
    run_id: str
    max_total: int
    max_owner: int
    attempt: int = 1


def _claim_statement() -> Insert:
    """One INSERT … SELECT … WHERE (active runs) < quota: the check and the claim are the same
    statement, so two claimers never both pass on one database."""
    active = RUNS.c.state.in_(ACTIVE_RUN_STATES)
    active_total = select(func.count()).select_from(RUNS).where(active).scalar_subquery()
    active_owner = (
        select(func.count())
        .select_from(RUNS.join(TASKS, TASKS.c.id == RUNS.c.task_id))
        .where(active, TASKS.c.owner == bindparam("owner"))
        .scalar_subquery()
    )
    already = (
        select(func.count())
        .select_from(RUNS)
        .where(RUNS.c.task_id == bindparam("task_id"), active)
        .scalar_subquery()
    )
    source = select(
        bindparam("run_id", type_=String),
        bindparam("task_id", type_=String),
        bindparam("attempt", type_=Integer),
        literal("starting"),
        literal(""),
        literal(0),
    ).where(
        active_total < bindparam("max_total", type_=Integer),
        active_owner < bindparam("max_owner", type_=Integer),
        already == 0,
    )
    return insert(RUNS).from_select(
        ["id", "task_id", "attempt", "state", "reason", "output_bytes"], source
    )


def _claim_params(claim: Claim) -> dict[str, Any]:
    return {
        "run_id": claim.run_id,
        "task_id": claim.task_id,
        "attempt": claim.attempt,
        "owner": claim.owner,
        "max_total": claim.max_total,
        "max_owner": claim.max_owner,
    }


def _update_task(with_artifacts: bool) -> Update:
    cols = ["state", "status_message", "history", "metadata", "version", "updated_at", "status_at"]
    if with_artifacts:
        cols.append("artifacts")
    return (
        update(TASKS)
        .where(TASKS.c.id == bindparam("_id"), TASKS.c.version == bindparam("_version"))
        .values({c: bindparam(c) for c in cols})
    )


# Built once: the hot path only binds values (no statement construction per call).
CLAIM_RUN = _claim_statement()
INSERT_TASK = insert(TASKS)
INSERT_EVENT = insert(EVENTS)
INSERT_IDEM = insert(IDEM)
UPDATE_TASK = _update_task(False)
UPDATE_TASK_ARTIFACTS = _update_task(True)


def _event_values(task_id: str, ev: EventRow) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "seq": ev.seq,
        "kind": ev.kind,
        "payload": ev.payload,
        "created_at": ev.created_at,
    }


def _filter_conditions(flt: TaskFilter) -> list[Any]:
    conds: list[Any] = []
    if flt.instance_id is not None:
        conds.append(m.Task.instance_id == flt.instance_id)
    if flt.incarnation is not None:
        conds.append(m.Task.incarnation == flt.incarnation)
    if flt.owner is not None:
        conds.append(m.Task.owner == flt.owner)
    if flt.context_id:
        conds.append(m.Task.context_id == flt.context_id)
    if flt.states:
        conds.append(m.Task.state.in_([s.value for s in flt.states]))
    if flt.status_after is not None:
        conds.append(m.Task.status_at > flt.status_after)
    return conds
