"""The one task state machine: every state change of every task goes through `transition`.

A transition is checked against `states.ALLOWED`, written to the database as a
compare-and-set on the task's version (with the output not yet flushed, so the stored output
never lags a stored state), then applied in memory, streamed to subscribers as a
TaskStatusUpdateEvent, written to the audit log (actor, cause, time) and published as a
`task.<state>` event, and counted in the metrics. Terminal states never change.

Output is appended here too (`append_output`): streamed at once, persisted in batches.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass
from typing import Any

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.tasks.live import LiveTask, LiveTasks
from agentic_sandbox.broker.tasks.record import TaskRecord, agent_message, utcnow
from agentic_sandbox.broker.tasks.states import TaskState, check_transition
from agentic_sandbox.broker.tasks.store import Claim, EventRow, TaskStore

log = logging.getLogger(__name__)

TRUNCATION_NOTE = "\n[output truncated: the stored artifact is capped at {cap} bytes]\n"


@dataclass(frozen=True)
class Step:
    """One transition, as `TaskMachine.advance` applies it."""

    to: TaskState
    actor: str
    cause: str
    message: str | None = None
    metadata: dict[str, Any] | None = None
    user_message: dict[str, Any] | None = None
    run_values: dict[str, Any] | None = None
    event_data: dict[str, Any] | None = None  # added to the `task.<state>` event


class StaleTask(Exception):
    """The task changed underneath (another writer won the compare-and-set)."""


class TaskMachine:
    def __init__(
        self,
        *,
        store: TaskStore,
        live: LiveTasks,
        audit: AuditLog,
        events: EventBus,
        metrics: Metrics,
        settings: Settings,
    ) -> None:
        self.store = store
        self.live = live
        self.audit = audit
        self.events = events
        self.metrics = metrics
        self.settings = settings
        self._flushing: set[asyncio.Task[None]] = set()

    # ---- creation -------------------------------------------------------------------------
    async def create(
        self,
        record: TaskRecord,
        *,
        actor: str,
        cause: str,
        idempotency: tuple[str, str, str] | None = None,
        claim: Claim | None = None,
    ) -> tuple[LiveTask | tuple[str, str], bool]:
        """Persist a new `submitted` task (claiming its run in the same transaction when
        `claim` is given). Returns (its LiveTask, claimed) — or ((request hash, task id) that
        already holds the idempotency key, False), and nothing is created then."""
        record.state = TaskState.submitted
        now = utcnow()
        record.created_at = record.updated_at = record.status_at = now
        live = LiveTask(record=record)
        first = EventRow(
            seq=live.next_seq(), kind="status", payload=record.status_event(), created_at=now
        )
        existing, claimed = await self.store.insert(
            record, first, idempotency=idempotency, claim=claim
        )
        if existing is not None:
            return existing, False
        self.live.add(live)
        self._record(live, None, TaskState.submitted, actor, cause)
        return live, claimed

    # ---- transitions ----------------------------------------------------------------------
    async def transition(
        self,
        live: LiveTask,
        to: TaskState,
        *,
        actor: str,
        cause: str,
        message: str | None = None,
        metadata: dict[str, Any] | None = None,
        user_message: dict[str, Any] | None = None,
        run_values: dict[str, Any] | None = None,
    ) -> None:
        """Move `live` to `to`. `message` becomes the status message (role agent) and joins
        the history; `user_message` (a client's follow-up) joins the history first."""
        await self.advance(
            live,
            [
                Step(
                    to,
                    actor=actor,
                    cause=cause,
                    message=message,
                    metadata=metadata,
                    user_message=user_message,
                    run_values=run_values,
                )
            ],
        )

    async def advance(self, live: LiveTask, steps: list[Step]) -> None:
        """Apply one or more transitions in order, stored in one write (each one still checked,
        streamed, audited and published on its own)."""
        async with live.lock:
            old = live.record
            # Build the next version aside; it replaces the live record only once stored, so
            # nobody ever reads a state the database does not have.
            rec = copy.copy(old)
            rec.history = list(old.history)
            rec.metadata = dict(old.metadata)
            states: list[TaskState] = []
            events: list[dict[str, Any]] = []
            rows: list[EventRow] = []
            written = live.unflushed[:]
            for row in written:
                row.sealed = True
            values: dict[str, Any] = {}
            for step in steps:
                check_transition(old.id, rec.state, step.to)
                states.append(rec.state)
                now = utcnow()
                if step.user_message is not None:
                    rec.history.append(step.user_message)
                rec.state = step.to
                rec.status_at = rec.updated_at = now
                rec.version += 1
                rec.status_message = None
                if step.message is not None:
                    rec.status_message = agent_message(rec.id, rec.context_id, step.message)
                    rec.history.append(rec.status_message)
                if step.metadata:
                    rec.metadata.update(step.metadata)
                if live.truncated:
                    rec.metadata["outputTruncated"] = True
                event = rec.status_event()
                events.append(event)
                rows.append(
                    EventRow(seq=live.next_seq(), kind="status", payload=event, created_at=now)
                )
                values.update(step.run_values or {})
            run = live.run
            if run is not None and written:
                values.setdefault("output_bytes", run.decoded_offset)
            ok = await self.store.write_transition(
                rec,
                old.version,
                [*written, *rows],
                artifacts=rec.artifacts() if rec.state.terminal else None,
                run_id=run.id if run is not None else None,
                run_values=values,
            )
            if not ok:
                raise StaleTask(f"task {rec.id} changed underneath; reload it")
            live.record = rec
            del live.unflushed[: len(written)]
            if run is not None and "output_bytes" in values:
                run.persisted_offset = values["output_bytes"]
            if not live.unflushed:
                self._cancel_flush(live)
            for step, before, event in zip(steps, states, events, strict=True):
                self.live.emit(live, event)
                self._record(live, before, step.to, step.actor, step.cause, step.event_data)
            if rec.state.terminal:
                self.live.remove(live)
                live.finish()

    def _record(
        self,
        live: LiveTask,
        from_state: TaskState | None,
        to: TaskState,
        actor: str,
        cause: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        rec = live.record
        session_id = live.run.session_id if live.run is not None else None
        self.audit.transition(
            actor,
            "task",
            rec.id,
            from_state.value if from_state is not None else None,
            to.value,
            cause=cause,
            detail={"instance_id": rec.instance_id, "owner": rec.owner},
        )
        self.events.publish(
            f"task.{to.value}",
            actor=actor,
            instance_id=rec.instance_id,
            task_id=rec.id,
            session_id=session_id,
            owner=rec.owner,
            data={
                "from": from_state.value if from_state is not None else None,
                "to": to.value,
                "cause": cause,
                "context_id": rec.context_id,
                **(extra or {}),
            },
        )
        self.metrics.task_transitions.labels(
            from_state.value if from_state is not None else "none", to.value
        ).inc()
        if to.terminal:
            self.metrics.task_duration.labels(to.value).observe(
                max(0.0, (rec.status_at - rec.created_at).total_seconds())
            )

    # ---- output ---------------------------------------------------------------------------
    def append_output(self, live: LiveTask, text: str, *, last_chunk: bool = False) -> None:
        """Stream one output chunk now; store it with the next flush (or transition)."""
        run = live.run
        if not text and not last_chunk:
            return
        if not text and run is not None and not run.emitted:
            return  # a run with no output at all has no artifact
        rec = live.record
        append = run.emitted if run is not None else bool(rec.output)
        if run is not None:
            run.emitted = True
        event = rec.artifact_event(text, append=append, last_chunk=last_chunk)
        seq = live.next_seq()
        self.live.emit(live, event)
        if text:
            stored = self._cap(live, text)
            if stored:
                rec.output.append(stored)
                last = live.unflushed[-1] if live.unflushed else None
                if last is not None and last.kind == "output" and not last.sealed:
                    prev = live.unflushed[-1]
                    prev.payload["text"] += stored
                    prev.seq = seq
                else:
                    live.unflushed.append(
                        EventRow(seq=seq, kind="output", payload={"text": stored})
                    )
        rec.updated_at = utcnow()
        self._schedule_flush(live)

    def add_artifact(self, live: LiveTask, artifact: dict[str, Any]) -> None:
        """Stream a whole artifact (an outbox file) now; it is stored with the task's end."""
        rec = live.record
        rec.file_artifacts.append(artifact)
        self.live.emit(
            live,
            {
                "artifactUpdate": {
                    "taskId": rec.id,
                    "contextId": rec.context_id,
                    "artifact": artifact,
                    "lastChunk": True,
                }
            },
        )

    def _cap(self, live: LiveTask, text: str) -> str:
        cap = self.settings.task_output_max_bytes
        if live.truncated:
            return ""
        size = len(text.encode())
        if live.output_bytes + size <= cap:
            live.output_bytes += size
            return text
        room = max(0, cap - live.output_bytes)
        kept = text.encode()[:room].decode("utf-8", "ignore")
        live.output_bytes = cap
        live.truncated = True
        return kept + TRUNCATION_NOTE.format(cap=cap)

    def _schedule_flush(self, live: LiveTask) -> None:
        if live.flush_handle is not None or not live.unflushed:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            task = asyncio.ensure_future(self.flush(live))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

        live.flush_handle = loop.call_later(self.settings.task_output_flush_seconds, fire)

    def _cancel_flush(self, live: LiveTask) -> None:
        if live.flush_handle is not None:
            live.flush_handle.cancel()
            live.flush_handle = None

    async def drain(self) -> None:
        """Store all buffered output now (server shutdown)."""
        for live in self.live.all():
            self._cancel_flush(live)
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)
        for live in self.live.all():
            await self.flush(live)

    async def flush(self, live: LiveTask) -> None:
        """Persist buffered output and the run offset it reaches."""
        live.flush_handle = None
        async with live.lock:
            if live.record.state.terminal:
                return
            run = live.run
            rows = list(live.unflushed)
            for row in rows:
                row.sealed = True
            offset = run.decoded_offset if run is not None else None
            if not rows and (run is None or offset == run.persisted_offset):
                return
            try:
                await self.store.append_output(
                    live.id,
                    rows,
                    updated_at=live.record.updated_at,
                    run_id=run.id if run is not None else None,
                    offset=offset,
                )
            except Exception:
                log.exception("storing output of task %s failed; will retry", live.id)
                self._schedule_flush(live)
                return
            del live.unflushed[: len(rows)]
            if run is not None and offset is not None:
                run.persisted_offset = offset
