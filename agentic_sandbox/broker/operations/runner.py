"""Long-running work (provisioning, image builds) as operations with stages and progress.

An operation is a row in `operations` plus a background task. Callers get the row at once (the
API answers 202 with it); the task reports stages as they begin, and the row ends
`succeeded`, `failed` (with `error.stage` and `error.cause`) or `canceled`. Every change is
written to the row and published as an `operation.*` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from agentic_sandbox.broker.cluster import interruption
from agentic_sandbox.broker.observability.logs import correlation_id
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

TERMINAL = frozenset({"succeeded", "failed", "canceled"})
MAX_BACKLOG = 10_000


class OperationFailed(Exception):
    """Raise inside an operation to end it `failed` with a stage and a cause."""

    def __init__(self, stage: str, cause: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(cause)
        self.stage = stage
        self.cause = cause
        self.detail = detail or {}


@dataclass
class Progress:
    """Handed to an operation's body to report its stage and timings."""

    op_id: str
    runner: OperationRunner
    stages: list[dict[str, Any]] = field(default_factory=list)
    planned: tuple[str, ...] = ()
    fraction: float = 0.0

    current: str | None = None

    def stage(self, name: str, stages: list[dict[str, Any]] | None = None) -> None:
        """Stage ``name`` begins, or (the same name again) has news in ``stages`` — the
        row is updated then, but no second `operation.stage` event is published."""
        if stages is not None:
            self.stages = stages
        if name == self.current:
            self.runner._schedule_update(self.op_id, stages=list(self.stages))
            return
        self.current = name
        fraction = self.fraction
        if self.planned and name in self.planned:
            fraction = max(fraction, self.planned.index(name) / max(1, len(self.planned) - 1))
        self.fraction = fraction  # progress never goes backwards
        self.runner._schedule_update(
            self.op_id, stage=name, progress=fraction, stages=list(self.stages)
        )


Body = Callable[[Progress], Awaitable[dict[str, Any] | None]]


class OperationRunner:
    def __init__(self, svc: Services) -> None:
        self._svc = svc
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._writes: deque[tuple[str, dict[str, Any]]] = deque()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # progress updates are applied one at a time, in order

    async def start(self) -> None:
        # Operations that were running when the server (or the leader) stopped cannot be
        # resumed: each fails, saying why, as a row and as an `operation.failed` event.
        cause = interruption(self._svc.cluster)
        async with self._svc.db.session() as s:
            rows = (
                await s.scalars(
                    select(m.Operation).where(m.Operation.state.in_(("pending", "running")))
                )
            ).all()
            ended = []
            for op in rows:
                op.state = "failed"
                op.error = {"stage": op.stage or "pending", "cause": cause}
                op.updated_at = dt.datetime.now(dt.UTC)
                ended.append((op.id, op.kind, op.subject_type, op.subject_id, op.owner, op.error))
        for op_id, kind, subject_type, subject_id, owner, error in ended:
            self._svc.events.publish(
                "operation.failed",
                actor="server",
                owner=owner,
                instance_id=subject_id if subject_type == "instance" else None,
                data={"operation_id": op_id, "kind": kind, "subject": subject_id, "error": error},
            )
        self._writer = asyncio.create_task(self._write_loop(), name="operation-writer")

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._drain()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer

    async def submit(
        self,
        *,
        kind: str,
        subject_type: str,
        subject_id: str,
        owner: str,
        actor: str,
        body: Body,
        planned: tuple[str, ...] = (),
    ) -> m.Operation:
        op = m.Operation(
            id=str(uuid.uuid4()),
            kind=kind,
            subject_type=subject_type,
            subject_id=subject_id,
            owner=owner,
            state="running",
            stage=planned[0] if planned else None,
            progress=0.0,
            stages=[],
        )
        async with self._svc.db.session() as s:
            s.add(op)
        self._svc.events.publish(
            "operation.started",
            actor=actor,
            owner=owner,
            instance_id=subject_id if subject_type == "instance" else None,
            data={"operation_id": op.id, "kind": kind, "subject": subject_id},
        )
        progress = Progress(op.id, self, planned=planned)
        task = asyncio.create_task(self._run(op, progress, body, actor), name=f"op-{op.id}")
        self._tasks[op.id] = task
        task.add_done_callback(functools.partial(self._forget, op.id))
        return op

    def _forget(self, op_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(op_id, None)

    async def cancel(self, op_id: str) -> bool:
        task = self._tasks.get(op_id)
        if task is None:
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return True

    async def wait(self, op_id: str) -> None:
        task = self._tasks.get(op_id)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(task)
        await self._drain()

    async def get(self, op_id: str) -> m.Operation | None:
        await self._drain()
        async with self._svc.db.session() as s:
            return await s.get(m.Operation, op_id)

    async def _run(self, op: m.Operation, progress: Progress, body: Body, actor: str) -> None:
        token = correlation_id.set(correlation_id.get() or op.id)
        try:
            result = await body(progress)
            await self._finish(op, "succeeded", progress, result=result or {})
        except OperationFailed as exc:
            await self._finish(
                op, "failed", progress, error={"stage": exc.stage, "cause": exc.cause, **exc.detail}
            )
        except asyncio.CancelledError:
            await asyncio.shield(
                self._finish(
                    op, "canceled", progress, error={"stage": "canceled", "cause": "canceled"}
                )
            )
        except Exception as exc:  # a bug: still end the operation with a reason
            log.exception("operation %s failed unexpectedly", op.id)
            await self._finish(
                op,
                "failed",
                progress,
                error={"stage": "internal", "cause": f"{type(exc).__name__}: {exc}"},
            )
        finally:
            correlation_id.reset(token)

    async def _finish(
        self,
        op: m.Operation,
        state: str,
        progress: Progress,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        await self._drain()
        async with self._svc.db.session() as s:
            row = await s.get(m.Operation, op.id)
            if row is None:
                return
            row.state = state
            row.stages = progress.stages or row.stages
            if state == "succeeded":
                row.progress = 1.0
                row.stage = "done"
            row.result = result
            row.error = error
            row.updated_at = dt.datetime.now(dt.UTC)
        self._svc.events.publish(
            f"operation.{state}",
            owner=op.owner,
            instance_id=op.subject_id if op.subject_type == "instance" else None,
            data={
                "operation_id": op.id,
                "kind": op.kind,
                "subject": op.subject_id,
                **({"error": error} if error else {}),
            },
        )

    def _schedule_update(self, op_id: str, **values: Any) -> None:
        if len(self._writes) >= MAX_BACKLOG:
            log.warning("operation progress backlog full; dropping an update of %s", op_id)
            return
        self._writes.append((op_id, values))
        self._wake.set()

    async def _apply(self, op_id: str, values: dict[str, Any]) -> None:
        async with self._svc.db.session() as s:
            row = await s.get(m.Operation, op_id)
            if row is None or row.state in TERMINAL:
                return
            for key, value in values.items():
                setattr(row, key, value)
        if "stage" in values:
            self._svc.events.publish(
                "operation.stage",
                owner=row.owner,
                instance_id=row.subject_id if row.subject_type == "instance" else None,
                data={"operation_id": op_id, "kind": row.kind, "stage": values["stage"]},
            )

    async def _drain(self) -> None:
        async with self._lock:
            while self._writes:
                op_id, values = self._writes.popleft()
                await self._apply(op_id, values)

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._drain()
            except Exception:
                log.exception("recording operation progress failed")
