"""The task service: what the A2A bindings, the v1 API and the admin roll-up call.

    submit -> idempotency (messageId) -> skill + input checks -> agent ready? -> quota
           -> task stored `submitted` (or stored and `rejected` with the reason)
           -> scheduler -> runner (a PTY session) -> working -> … -> terminal

Callers are identified by a `Caller`; a task is visible to its owner and to admins only, and
never across instances on the per-instance surface (unknown and invisible look the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import rfc8785
from pydantic import ValidationError

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.sessions import (
    BudgetIn,
    BudgetInvalid,
    BudgetOut,
    SessionService,
    check_budget_support,
    loadout_budgets,
    resolve_budget,
)
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store.rowcache import RowCache
from agentic_sandbox.broker.tasks.errors import (
    IdempotencyConflict,
    InvalidTaskInput,
    PushConfigNotFound,
    QuotaExceeded,
    TaskNotCancelable,
    TaskNotFound,
    TaskNotWaiting,
)
from agentic_sandbox.broker.tasks.files import InFile, TaskFiles, check_files, file_part
from agentic_sandbox.broker.tasks.live import LiveTask, LiveTasks, RunState, StreamEvent, Subscriber
from agentic_sandbox.broker.tasks.machine import TaskMachine
from agentic_sandbox.broker.tasks.push import PushConfigView, PushNotifier
from agentic_sandbox.broker.tasks.record import TaskRecord
from agentic_sandbox.broker.tasks.runner import SYSTEM_ACTOR, TaskRunner
from agentic_sandbox.broker.tasks.scheduler import Scheduler
from agentic_sandbox.broker.tasks.skills import (
    SHELL_SKILL_ID,
    AgentProfile,
    Rejection,
    RunPlan,
    load_profile,
    plan_run,
)
from agentic_sandbox.broker.tasks.states import ACTIVE, IllegalTransition, TaskState
from agentic_sandbox.broker.tasks.store import Page, TaskFilter, TaskStore

log = logging.getLogger(__name__)

INSTANCE_TTL = 2.0  # on PostgreSQL: seconds an instance record is reused before it is read again


def json_key(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str) if value is not None else ""


@dataclass(frozen=True)
class Caller:
    subject: str  # owner name the caller acts as
    actor: str  # written to the audit log and events
    is_admin: bool = False

    def can_see(self, record: TaskRecord) -> bool:
        return self.is_admin or record.owner == self.subject


@dataclass(frozen=True)
class PushRequest:
    url: str
    token: str | None = None
    config_id: str | None = None
    scheme: str | None = None
    credentials: str | None = None


@dataclass
class TaskStream:
    """A snapshot of the task, then its live events (`subscriber` is None once it ended)."""

    snapshot: TaskRecord
    subscriber: Subscriber | None

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Async iterator of StreamResponse objects after the snapshot."""
        sub = self.subscriber
        if sub is None:
            return
        try:
            while True:
                event = await sub.next()
                if event is None:
                    return
                yield event
        finally:
            sub.close()

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()


@dataclass(frozen=True)
class MessageInput:
    text: str
    data: Any
    has_data: bool
    skill_id: str
    budget: BudgetIn = dataclasses.field(default_factory=BudgetIn)  # metadata `budget`
    files: tuple[InFile, ...] = ()  # raw file parts, for the task's working directory


def _asked_budget(message: dict[str, Any], request_metadata: dict[str, Any] | None) -> BudgetIn:
    for where, meta in (
        ("message.metadata", message.get("metadata") or {}),
        ("metadata", request_metadata or {}),
    ):
        if not isinstance(meta, dict) or "budget" not in meta:
            continue
        try:
            return BudgetIn.model_validate(meta["budget"])
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            field = f"{where}.budget" + (f".{loc}" if loc else "")
            raise InvalidTaskInput(f"{field}: {err['msg']}", field=field) from None
    return BudgetIn()


def message_input(
    message: dict[str, Any],
    request_metadata: dict[str, Any] | None,
    max_file_bytes: int = 8 * 1024 * 1024,
) -> MessageInput:
    """What a message asks for: its text, its data part, its files (files.py) and the skill
    (metadata `skillId`)."""
    texts: list[str] = []
    files: list[InFile] = []
    data: Any = None
    has_data = False
    for i, part in enumerate(message.get("parts") or []):
        if "text" in part:
            texts.append(part["text"])
        elif "data" in part:
            if has_data:
                raise InvalidTaskInput(
                    "only one data part per message", field=f"message.parts[{i}].data"
                )
            data, has_data = part["data"], True
        elif "raw" in part or "url" in part:
            files.append(file_part(part, i, max_file_bytes))
    check_files(files)
    skill = SHELL_SKILL_ID
    for meta in (message.get("metadata") or {}, request_metadata or {}):
        value = meta.get("skillId", meta.get("skill"))
        if value is not None:
            if not isinstance(value, str) or not value:
                raise InvalidTaskInput(
                    "skillId must be a non-empty string", field="metadata.skillId"
                )
            skill = value
            break
    return MessageInput(
        "\n".join(texts),
        data,
        has_data,
        skill,
        _asked_budget(message, request_metadata),
        tuple(files),
    )


def request_hash(message: dict[str, Any], skill: str) -> str:
    """A digest of what was asked (JCS, so key order and number spelling do not matter)."""
    body: Any = {"message": message, "skill": skill}
    try:
        canonical = rfc8785.dumps(body)
    except (rfc8785.CanonicalizationError, ValueError, TypeError):  # e.g. integers beyond 2**53
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


class TaskService:
    def __init__(
        self,
        *,
        db: Database,
        machine: TaskMachine,
        events: EventBus,
        push: PushNotifier,
        sessions: Callable[[], SessionService | None],
        settings: Settings,
    ) -> None:
        self.db = db
        self.machine = machine
        self.store: TaskStore = machine.store
        self.live: LiveTasks = machine.live
        self.events = events
        self.push = push
        self.settings = settings
        self._sessions = sessions
        self.scheduler = Scheduler(store=self.store, settings=settings, start_run=self._start_run)
        self.runner = TaskRunner(
            machine=machine,
            live=self.live,
            sessions=sessions,
            cancel_grace=settings.task_cancel_grace_seconds,
            recovery_grace=settings.task_recovery_grace_seconds,
            on_run_end=self.scheduler.run_ended,
            settings=settings,
        )
        self.live.add_listener(push.on_event)
        self._listening = False
        self.files: TaskFiles | None = None  # the files path (use_files), None in unit tests
        self._instances: RowCache[m.Instance] = RowCache(
            db, m.Instance.__tablename__, self._read_instance, untracked_ttl=INSTANCE_TTL
        )
        self._profiles: dict[tuple[Any, ...], AgentProfile] = {}

    def use_files(self, files: TaskFiles) -> None:
        """The files path for A2A file parts (wired in `broker/components.py`)."""
        self.files = files
        self.runner.files = files

    def use_egress_bytes(self, count: Callable[[str], tuple[int, int]]) -> None:
        """The egress proxy's byte count per run (wired in `broker/components.py`): each run's
        usage reports what its connections sent and received."""
        self.runner.egress_bytes = count

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.push.start()
        await self.scheduler.start()
        self.listen_for_prompts()
        await self._recover()

    def listen_for_prompts(self) -> None:
        sessions = self._sessions()
        if sessions is not None and not self._listening:
            sessions.add_prompt_listener(self.runner.on_prompt)
            self._listening = True

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.runner.stop()
        for live in self.live.all():
            for sub in tuple(live.subscribers):
                sub.end()
        await self.push.stop()
        await self.store.close()

    async def _recover(self) -> None:
        rows = await self.store.unfinished()
        for row in rows:
            try:
                await self._recover_one(row)
            except Exception:
                log.exception("recovering task %s failed", row.id)
        if rows:
            log.info("recovered %d unfinished tasks", len(rows))

    async def _recover_one(self, row: m.Task) -> None:
        output, seq = await self.store.output_text(row.id)
        rec = TaskRecord.from_row(row, output_text=output)
        live = LiveTask(
            record=rec,
            seq=seq,
            output_bytes=len(output.encode()),
            truncated=bool(rec.metadata.get("outputTruncated")),
        )
        self.live.add(live)
        run = await self.store.active_run(row.id)
        if run is not None:
            live.run = RunState(
                id=run.id,
                attempt=run.attempt,
                session_id=run.session_id,
                offset=run.output_bytes,
                persisted_offset=run.output_bytes,
                emitted=bool(output),
                budget=run.budget,
            )
        cause = "server restart"
        if rec.state is TaskState.submitted:
            if live.run is not None:
                # The session was stored before it was opened on the agent: when it exists,
                # the run may be going on there (its `working` was not stored yet): adopt it.
                # Without one the run never reached the agent; it is not started again.
                sid = live.run.session_id or await self.store.open_session_of(row.id)
                if sid is not None:
                    await self.runner.adopt_unconfirmed(live, sid)
                    return
                reason = "the server stopped while the run was starting; it was not re-run"
                await self._end(live, TaskState.rejected, reason, run_state="lost")
                return
            try:
                live.plan = await self.plan_for(rec)
            except Rejection as exc:
                await self._end(live, TaskState.rejected, exc.reason)
                return
            self.scheduler.enqueue(live, reserved=False)
            return
        if live.run is None or live.run.session_id is None:
            reason = f"run lost: the server stopped and no run of the task survives ({cause})"
            await self._end(live, TaskState.failed, reason, run_state="lost")
            return
        self.live.bind_session(live, live.run.session_id)
        self.runner.adopt(live)

    async def _end(
        self, live: LiveTask, to: TaskState, reason: str, *, run_state: str | None = None
    ) -> None:
        run_values = {"state": run_state, "reason": reason} if run_state else None
        with contextlib.suppress(IllegalTransition):
            await self.machine.transition(
                live, to, actor=SYSTEM_ACTOR, cause=reason, message=reason, run_values=run_values
            )
        self.scheduler.run_ended(live)

    def _start_run(self, live: LiveTask) -> None:
        plan: RunPlan = live.plan
        live.plan = None
        self.runner.start(live, plan)

    # ---- instances ------------------------------------------------------------------------
    async def end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's unfinished tasks fail with the reason (queued ones never
        run; a running one's session was ended by the session hub)."""
        self._instances.forget(ended.instance_id)
        reason = f"the instance ended: {ended.reason}"
        for live in list(self.live.all()):
            rec = live.record
            if rec.instance_id != ended.instance_id or rec.state.terminal:
                continue
            if rec.incarnation not in (None, ended.incarnation):
                continue
            if live.run is None:
                self.scheduler.dequeue(live)
            await self._end(live, TaskState.failed, reason, run_state="lost")

    async def instance(self, instance_id: str) -> m.Instance | None:
        """The live instance record (every A2A call needs it): from memory while nothing wrote
        the instances table (`store/rowcache.py`; on PostgreSQL for INSTANCE_TTL seconds).
        Read-only: the record is shared by its callers."""
        return await self._instances.get(instance_id)

    async def _read_instance(self, instance_id: str) -> m.Instance | None:
        async with self.db.session() as s:
            row = await s.get(m.Instance, instance_id)
        return None if row is None or row.deleted_at is not None else row

    async def profile(self, instance: m.Instance) -> AgentProfile:
        """Skills and runner of an instance (parsed once per version of its spec)."""
        loadout_spec: dict[str, Any] | None = None
        if (
            "skills" not in (instance.spec or {})
            and instance.loadout
            and instance.loadout_version is not None
        ):
            # the exact version the instance was made from, never the name's active one
            async with self.db.session() as s:
                version = await s.get(
                    m.LoadoutVersion, (instance.loadout, instance.loadout_version)
                )
            loadout_spec = version.resolved if version is not None else None
        key = (instance.id, instance.version, instance.updated_at, json_key(loadout_spec))
        hit = self._profiles.get(key)
        if hit is None:
            if len(self._profiles) > 10_000:
                self._profiles.clear()
            hit = self._profiles[key] = load_profile(instance.spec or {}, loadout_spec)
        return hit

    def files_available(self, instance_id: str) -> bool:
        return self.files is not None and self.files.available(instance_id)

    def agent_ready(self, instance_id: str) -> bool:
        sessions = self._sessions()
        return sessions is not None and sessions.agent_ready(instance_id)

    async def plan_for(self, rec: TaskRecord) -> RunPlan:
        """The run of a task, from its first message and its instance's current profile."""
        instance = await self.instance(rec.instance_id)
        if instance is None:
            raise Rejection("the instance no longer exists")
        first = rec.history[0] if rec.history else {"parts": []}
        inp = message_input(
            first, rec.metadata.get("requestMetadata"), self.settings.task_file_max_bytes
        )
        profile = await self.profile(instance)
        skill = profile.skill(inp.skill_id)
        if skill is None:
            raise Rejection(f"unknown skill {inp.skill_id!r}", "metadata.skillId")
        try:
            budget = await self.run_budget(instance, inp.budget)
        except InvalidTaskInput as exc:
            raise Rejection(exc.message, exc.field) from None
        plan = plan_run(
            profile,
            skill,
            text=inp.text,
            data=inp.data,
            has_data=inp.has_data,
            task_id=rec.id,
            context_id=rec.context_id,
        )
        return dataclasses.replace(plan, budget=budget, files=inp.files)

    async def run_budget(self, instance: m.Instance, asked: BudgetIn) -> BudgetOut:
        """A run's budget: what the message asks, within the instance's loadout budgets
        (InvalidTaskInput naming the field above a ceiling)."""
        try:
            return resolve_budget(
                asked, await loadout_budgets(self.db, instance), where="metadata.budget"
            )
        except BudgetInvalid as exc:
            raise InvalidTaskInput(exc.detail, field=exc.field) from None

    def budget_problem(self, instance_id: str, budget: BudgetOut) -> str | None:
        """Why the instance's agent cannot run this budget (None: it can)."""
        sessions = self._sessions()
        support = sessions.budget_support(instance_id) if sessions is not None else None
        if support is None:
            return None  # not connected: rejected as not ready
        try:
            check_budget_support(
                budget,
                support.enforcement,
                support.budgets,
                support.problem,
                instance_id,
                where="metadata.budget",
            )
        except BudgetInvalid as exc:
            return f"{exc.field}: {exc.message}"
        return None

    # ---- submit ---------------------------------------------------------------------------
    async def submit(
        self,
        *,
        instance_id: str,
        caller: Caller,
        message: dict[str, Any],
        request_metadata: dict[str, Any] | None = None,
        push: PushRequest | None = None,
        refuse_over_quota: bool = False,
    ) -> TaskRecord:
        """Create a task from a message (or answer one: `message.taskId`); see the module doc.

        Returns the task as it is now (submitted, or rejected with the reason). Raises
        IdempotencyConflict, TaskNotFound, TaskNotWaiting, InvalidTaskInput,
        UnsupportedContent, and QuotaExceeded when `refuse_over_quota` (v1: HTTP 429).
        """
        # Why the steps run in this order:
        # 1. Parse and check the message before anything else: malformed input is an error
        #    answer (4xx), not a task, so a typo never costs a row, a slot or an event.
        # 2. A follow-up (`taskId`) or a replayed messageId is settled before the instance is
        #    looked up: a retry must get the same answer even if the instance changed since.
        # 3. Skill, input and agent checks *reject* the task rather than raise: the caller gets
        #    a task id it can look up, as A2A wants for input the agent could not run.
        # 4. The quota slot is reserved before the row is written and released on every path
        #    that does not run (insert failed, duplicate messageId): a reservation that leaks
        #    would block the caller's later tasks for good.
        # 5. The row, the idempotency key and the run claim are one write (`machine.create`),
        #    so two servers racing for one messageId or one slot cannot both win.
        # 6. Push config is stored before any transition, so the first state change already
        #    notifies; only then is the run started (or queued when another server holds the
        #    slot).
        inp = message_input(message, request_metadata, self.settings.task_file_max_bytes)
        message_id = str(message.get("messageId") or "")
        if not message_id:
            raise InvalidTaskInput("messageId is required", field="message.messageId")
        scope = f"{instance_id}:{caller.subject}"
        digest = request_hash(message, inp.skill_id)
        if message.get("taskId"):
            hit = await self.store.idempotent_result(scope, message_id)
            if hit is not None:
                return await self._replay(hit, digest, caller, instance_id)
            return await self._follow_up(instance_id, caller, message, inp, scope, digest)
        # A new message: the idempotency key is inserted with the task; a duplicate messageId
        # makes that insert fail and is answered from the task that holds the key.

        instance = await self.instance(instance_id)
        if instance is None or not (caller.is_admin or instance.owner == caller.subject):
            raise TaskNotFound(f"no instance {instance_id!r}", field="instance_id")
        budget = await self.run_budget(instance, inp.budget)
        task_id = str(uuid.uuid4())
        context_id = str(message.get("contextId") or uuid.uuid4())
        user_msg = {**message, "taskId": task_id, "contextId": context_id}
        metadata: dict[str, Any] = {"instanceId": instance_id, "skillId": inp.skill_id}
        if request_metadata:
            metadata["requestMetadata"] = request_metadata
        rec = TaskRecord(
            id=task_id,
            instance_id=instance_id,
            incarnation=instance.incarnation,
            owner=caller.subject,
            context_id=context_id,
            state=TaskState.submitted,
            skill=inp.skill_id,
            message_id=message_id,
            history=[user_msg],
            metadata=metadata,
        )
        rejection: str | None = None
        plan: RunPlan | None = None
        profile = await self.profile(instance)
        skill = profile.skill(inp.skill_id)
        try:
            if skill is None:
                known = ", ".join(s.id for s in profile.skills)
                raise Rejection(f"unknown skill {inp.skill_id!r} (this agent has: {known})")
            plan = plan_run(
                profile,
                skill,
                text=inp.text,
                data=inp.data,
                has_data=inp.has_data,
                task_id=task_id,
                context_id=context_id,
            )
            plan = dataclasses.replace(plan, budget=budget, files=inp.files)
        except Rejection as exc:
            rejection = f"invalid input: {exc.reason}"
        if rejection is None:
            unenforceable = self.budget_problem(instance_id, budget)
            if unenforceable is not None:
                rejection = f"budget not enforceable: {unenforceable}"
        if rejection is None and inp.files and not self.files_available(instance_id):
            rejection = (
                f"files not supported: the agent of {instance_id!r} does not transfer files, "
                "so the message's file parts cannot reach the run"
            )
        if rejection is None and not self.agent_ready(instance_id):
            rejection = f"instance not ready: the agent of {instance_id!r} is not connected"
        admitted: bool | None = None  # None: not admitted; True: runs now; False: queued
        if rejection is None:
            try:
                admitted = self.scheduler.reserve(caller.subject)
            except QuotaExceeded as exc:
                if refuse_over_quota:
                    raise
                rejection = f"quota exceeded: {exc.message}"
        run_id = str(uuid.uuid4())
        claim = self.scheduler.claim_for(task_id, caller.subject, run_id) if admitted else None
        try:
            created, claimed = await self.machine.create(
                rec,
                actor=caller.actor,
                cause="submitted",
                idempotency=(scope, message_id, digest),
                claim=claim,
            )
        except BaseException:
            if admitted is not None:
                self.scheduler.release(caller.subject, admitted)
            raise
        if isinstance(created, tuple):  # the messageId was used before
            if admitted is not None:
                self.scheduler.release(caller.subject, admitted)
            return await self._replay(created, digest, caller, instance_id)
        live = created
        if push is not None:
            await self.put_push_config(live.record, push)
        if rejection is not None:
            await self.machine.transition(
                live, TaskState.rejected, actor=caller.actor, cause=rejection, message=rejection
            )
            return live.record
        assert plan is not None
        if claimed:  # the run slot is ours: start now, no queue hop
            live.run = RunState(id=run_id)
            self.runner.start(live, plan)
            return live.record
        if admitted:  # the database said no (another server took the slot): queue it
            self.scheduler.release(caller.subject, True)
            self.scheduler.reserve_queue(caller.subject)
        live.plan = plan
        self.scheduler.enqueue(live)
        return live.record

    async def _replay(
        self, hit: tuple[str, str], digest: str, caller: Caller, instance_id: str
    ) -> TaskRecord:
        stored_digest, task_id = hit
        if stored_digest != digest:
            raise IdempotencyConflict(
                "this messageId was already used with different content; use a new messageId",
                field="message.messageId",
            )
        return await self.get(task_id, caller, instance_id=instance_id)

    async def _follow_up(
        self,
        instance_id: str,
        caller: Caller,
        message: dict[str, Any],
        inp: MessageInput,
        scope: str,
        digest: str,
    ) -> TaskRecord:
        task_id = str(message["taskId"])
        rec = await self.get(task_id, caller, instance_id=instance_id)
        ctx = message.get("contextId")
        if ctx and ctx != rec.context_id:
            raise InvalidTaskInput(
                f"contextId {ctx!r} is not the context of task {task_id}",
                field="message.contextId",
            )
        live = self.live.get(task_id)
        if live is None or rec.state is not TaskState.input_required:
            raise TaskNotWaiting(
                f"task {task_id} is {rec.state.value}; only a task in input-required takes a "
                "follow-up message"
            )
        if (inp.has_data or inp.files) and not inp.text:
            raise InvalidTaskInput("the answer must be a text part", field="message.parts")
        user_msg = {**message, "contextId": rec.context_id}
        await self.runner.answer(live, inp.text, user_message=user_msg, actor=caller.actor)
        await self.store.remember_key(scope, str(message["messageId"]), digest, task_id)
        return live.record

    # ---- read -----------------------------------------------------------------------------
    async def get(
        self, task_id: str, caller: Caller, *, instance_id: str | None = None
    ) -> TaskRecord:
        live = self.live.get(task_id)
        if live is not None:
            rec = live.record
        else:
            row = await self.store.get(task_id) if len(task_id) <= 64 else None
            if row is None:
                raise TaskNotFound(f"no task {task_id!r}", field="id")
            rec = TaskRecord.from_row(row)
        if not caller.can_see(rec) or (instance_id is not None and rec.instance_id != instance_id):
            raise TaskNotFound(f"no task {task_id!r}", field="id")
        if instance_id is not None and rec.incarnation is not None:
            # under /agents/{id}: only the tasks of the instance that has the id now
            instance = await self.instance(instance_id)
            if instance is None or instance.incarnation != rec.incarnation:
                raise TaskNotFound(f"no task {task_id!r}", field="id")
        return rec

    async def list_tasks(
        self, flt: TaskFilter, *, page_size: int, page_token: str = ""
    ) -> tuple[list[TaskRecord], Page]:
        page = await self.store.page(flt, page_size=page_size, page_token=page_token)
        out = []
        for row in page.rows:
            live = self.live.get(row.id)
            out.append(live.record if live is not None else TaskRecord.from_row(row))
        return out, page

    # ---- control --------------------------------------------------------------------------
    async def cancel(
        self, task_id: str, caller: Caller, *, instance_id: str | None = None
    ) -> TaskRecord:
        rec = await self.get(task_id, caller, instance_id=instance_id)
        live = self.live.get(task_id)
        if live is None or rec.state.terminal:
            raise TaskNotCancelable(
                f"task {task_id} is already {rec.state.value}", state=rec.state.value
            )
        if live.run is None:
            self.scheduler.dequeue(live)
        await self.runner.cancel(live, actor=caller.actor)
        return live.record

    async def open_stream(
        self, task_id: str, caller: Caller, *, instance_id: str | None = None, queue: int = 1000
    ) -> TaskStream:
        rec = await self.get(task_id, caller, instance_id=instance_id)
        live = self.live.get(task_id)
        if live is None or rec.state.terminal:
            return TaskStream(snapshot=rec, subscriber=None)
        sub = live.subscribe(queue)  # subscribe and snapshot with no await in between
        return TaskStream(snapshot=live.record, subscriber=sub)

    async def wait_settled(self, task_id: str, seconds: float) -> TaskRecord | None:
        """Wait until the task is terminal or waits for the client; None if it vanished."""
        live = self.live.get(task_id)
        if live is None:
            row = await self.store.get(task_id)
            return TaskRecord.from_row(row) if row is not None else None
        if _settled(live.record.state):
            return live.record
        sub = live.subscribe(64)
        deadline = time.monotonic() + seconds
        try:
            while not _settled(live.record.state):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):
                        event = await sub.next()
                except TimeoutError:
                    break
                if event is None:
                    break
        finally:
            sub.close()
        return live.record

    # ---- push configs ---------------------------------------------------------------------
    async def put_push_config(self, rec: TaskRecord, push: PushRequest) -> PushConfigView:
        return await self.push.put(
            task_id=rec.id,
            instance_id=rec.instance_id,
            owner=rec.owner,
            url=push.url,
            token=push.token,
            config_id=push.config_id,
            scheme=push.scheme,
            credentials=push.credentials,
            deliver=not rec.state.terminal,  # kept for an ended task, never sent
        )

    async def push_configs(self, rec: TaskRecord) -> list[PushConfigView]:
        return [self.push.view(r) for r in await self.store.push_configs(rec.id)]

    async def push_config(self, rec: TaskRecord, config_id: str) -> PushConfigView:
        row = await self.store.get_push_config(rec.id, config_id)
        if row is None:
            raise PushConfigNotFound(
                f"task {rec.id} has no push notification config {config_id!r}", field="id"
            )
        return self.push.view(row)

    async def delete_push_config(self, rec: TaskRecord, config_id: str) -> None:
        await self.push.delete(rec.id, config_id)

    # ---- stats ----------------------------------------------------------------------------
    def active_counts(self) -> dict[tuple[str, ...], float]:
        counts: dict[tuple[str, ...], float] = {
            (s.value,): 0.0 for s in (TaskState.submitted, *ACTIVE)
        }
        for live in self.live.all():
            key = (live.record.state.value,)
            counts[key] = counts.get(key, 0.0) + 1
        return counts


def _settled(state: TaskState) -> bool:
    return state.terminal or state.interrupted


__all__ = [
    "Caller",
    "MessageInput",
    "PushRequest",
    "StreamEvent",
    "TaskService",
    "TaskStream",
    "message_input",
]
