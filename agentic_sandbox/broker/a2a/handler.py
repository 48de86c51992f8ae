"""The one A2A request handler both bindings (JSON-RPC and HTTP+JSON) call.

It takes validated requests (`broker.a2a.models`) and a resolved call context (instance and
principal), checks scopes, calls the task service and returns A2A 1.0 JSON objects — or raises
`A2AError`s, which each binding renders in its own format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentic_sandbox.broker.a2a import errors as e
from agentic_sandbox.broker.a2a.card import CardCache, build_card
from agentic_sandbox.broker.a2a.models import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
)
from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.http.health import VERSION
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks import (
    Caller,
    IdempotencyConflict,
    InvalidPushConfig,
    InvalidTaskInput,
    PushConfigNotFound,
    PushConfigView,
    PushRequest,
    QuotaExceeded,
    TaskError,
    TaskFilter,
    TaskNotCancelable,
    TaskNotFound,
    TaskNotWaiting,
    TaskRecord,
    TaskService,
    TaskStream,
    UnsupportedContent,
)

SCOPE_READ = "a2a:read"
SCOPE_INVOKE = "a2a:invoke"
DEFAULT_PAGE = 50
TEXT_MODES = ("text/plain", "text/*", "*/*", "*")


@dataclass(frozen=True)
class A2ACall:
    """Who calls which agent."""

    instance: m.Instance
    principal: Principal

    @property
    def instance_id(self) -> str:
        return self.instance.id

    @property
    def caller(self) -> Caller:
        p = self.principal
        return Caller(subject=p.subject, actor=p.actor, is_admin=p.is_admin)

    def require(self, scope: str) -> None:
        p = self.principal
        if p.kind == "apikey":
            allowed = scope in p.scopes or (scope == SCOPE_READ and SCOPE_INVOKE in p.scopes)
            if not allowed:
                raise e.PermissionDeniedError(
                    f"this API key lacks the {scope} scope (it has: "
                    f"{', '.join(sorted(p.scopes)) or 'none'})",
                    metadata={"requiredScope": scope},
                )
        elif scope == SCOPE_INVOKE and not p.role.allows(Role.operator):
            raise e.PermissionDeniedError(
                f"the {p.role.value} role reads only; sending and canceling need operator",
                metadata={"requiredRole": "operator"},
            )


def task_error(exc: TaskError) -> e.A2AError:
    """Map a task-layer error to its A2A error."""
    field = [{"field": exc.field, "description": exc.message}] if exc.field else None
    if isinstance(exc, TaskNotFound | PushConfigNotFound):
        return e.TaskNotFoundError(exc.message)
    if isinstance(exc, TaskNotCancelable):
        return e.TaskNotCancelableError(exc.message, metadata=exc.detail)
    if isinstance(exc, TaskNotWaiting):
        return e.UnsupportedOperationError(exc.message)
    if isinstance(exc, UnsupportedContent):
        return e.ContentTypeNotSupportedError(exc.message, fields=field)
    if isinstance(exc, IdempotencyConflict | InvalidTaskInput | InvalidPushConfig):
        return e.InvalidParamsError(exc.message, fields=field)
    if isinstance(exc, QuotaExceeded):
        return e.QuotaExceededError(exc.message, headers={"Retry-After": str(exc.retry_after)})
    return e.InternalError(exc.message)


def push_json(view: PushConfigView) -> dict[str, Any]:
    out: dict[str, Any] = {"id": view.id, "taskId": view.task_id, "url": view.url}
    if view.token:
        out["token"] = view.token
    if view.scheme:
        out["authentication"] = {"scheme": view.scheme}  # credentials are never shown again
    return out


def push_request(cfg: TaskPushNotificationConfig) -> PushRequest:
    auth = cfg.authentication
    return PushRequest(
        url=cfg.url,
        token=cfg.token or None,
        config_id=cfg.id or None,
        scheme=auth.scheme if auth is not None else None,
        credentials=auth.credentials if auth is not None else None,
    )


class A2AHandler:
    def __init__(self, tasks: TaskService, cards: CardCache, settings: Settings) -> None:
        self.tasks = tasks
        self.cards = cards
        self.settings = settings

    # ---- messages -------------------------------------------------------------------------
    async def _submit(self, call: A2ACall, req: SendMessageRequest) -> TaskRecord:
        call.require(SCOPE_INVOKE)
        cfg = req.configuration
        if cfg is not None and cfg.accepted_output_modes:
            modes = [mode.split(";")[0].strip().lower() for mode in cfg.accepted_output_modes]
            if not any(mode in TEXT_MODES for mode in modes):
                raise e.ContentTypeNotSupportedError(
                    "this agent answers in text/plain; acceptedOutputModes excludes it",
                    fields=[
                        {
                            "field": "configuration.acceptedOutputModes",
                            "description": "must accept text/plain",
                        }
                    ],
                )
        if req.message.role != "ROLE_USER":
            raise e.InvalidParamsError(
                "a client's message has role ROLE_USER",
                fields=[{"field": "message.role", "description": "must be ROLE_USER"}],
            )
        push = None
        if cfg is not None and cfg.task_push_notification_config is not None:
            push = push_request(cfg.task_push_notification_config)
        try:
            return await self.tasks.submit(
                instance_id=call.instance_id,
                caller=call.caller,
                message=req.message.dump(),
                request_metadata=req.metadata or None,
                push=push,
            )
        except TaskError as exc:
            raise task_error(exc) from None

    async def send_message(self, call: A2ACall, req: SendMessageRequest) -> dict[str, Any]:
        rec = await self._submit(call, req)
        cfg = req.configuration
        history = cfg.history_length if cfg is not None else None
        if cfg is None or not cfg.return_immediately:
            settled = await self.tasks.wait_settled(
                rec.id, self.settings.task_blocking_timeout_seconds
            )
            rec = settled or rec
        return {"task": rec.to_a2a(history_length=history)}

    async def send_streaming_message(self, call: A2ACall, req: SendMessageRequest) -> TaskStream:
        rec = await self._submit(call, req)
        return await self._stream(call, rec.id)

    async def _stream(self, call: A2ACall, task_id: str) -> TaskStream:
        try:
            return await self.tasks.open_stream(
                task_id,
                call.caller,
                instance_id=call.instance_id,
                queue=self.settings.sse_client_queue,
            )
        except TaskError as exc:
            raise task_error(exc) from None

    # ---- tasks ----------------------------------------------------------------------------
    async def get_task(self, call: A2ACall, req: GetTaskRequest) -> dict[str, Any]:
        call.require(SCOPE_READ)
        try:
            rec = await self.tasks.get(req.id, call.caller, instance_id=call.instance_id)
        except TaskError as exc:
            raise task_error(exc) from None
        return rec.to_a2a(history_length=req.history_length)

    async def list_tasks(self, call: A2ACall, req: ListTasksRequest) -> dict[str, Any]:
        call.require(SCOPE_READ)
        p = call.principal
        instance = await self.tasks.instance(call.instance_id)
        flt = TaskFilter(
            instance_id=call.instance_id,
            incarnation=instance.incarnation if instance is not None else "none",
            owner=None if p.is_admin else p.subject,
            context_id=req.context_id or None,
            states=(req.status,) if req.status else (),
            status_after=req.status_timestamp_after,
        )
        size = req.page_size or DEFAULT_PAGE
        try:
            records, page = await self.tasks.list_tasks(
                flt, page_size=size, page_token=req.page_token or ""
            )
        except InvalidTaskInput as exc:
            raise e.InvalidParamsError(
                exc.message, fields=[{"field": "pageToken", "description": exc.message}]
            ) from None
        return {
            "tasks": [
                r.to_a2a(history_length=req.history_length, include_artifacts=req.include_artifacts)
                for r in records
            ],
            "nextPageToken": page.next_token,
            "pageSize": size,
            "totalSize": page.total,
        }

    async def cancel_task(self, call: A2ACall, req: CancelTaskRequest) -> dict[str, Any]:
        call.require(SCOPE_INVOKE)
        try:
            rec = await self.tasks.cancel(req.id, call.caller, instance_id=call.instance_id)
        except TaskError as exc:
            raise task_error(exc) from None
        return rec.to_a2a()

    async def subscribe(self, call: A2ACall, req: SubscribeToTaskRequest) -> TaskStream:
        call.require(SCOPE_READ)
        stream = await self._stream(call, req.id)
        if stream.subscriber is None:
            raise e.UnsupportedOperationError(
                f"task {req.id} is {stream.snapshot.state.value}; a terminal task has no "
                "updates to subscribe to (use GetTask)"
            )
        return stream

    # ---- push notification configs --------------------------------------------------------
    async def _task(self, call: A2ACall, task_id: str) -> TaskRecord:
        try:
            return await self.tasks.get(task_id, call.caller, instance_id=call.instance_id)
        except TaskError as exc:
            raise task_error(exc) from None

    async def create_push_config(
        self, call: A2ACall, req: TaskPushNotificationConfig, task_id: str | None = None
    ) -> dict[str, Any]:
        call.require(SCOPE_INVOKE)
        tid = task_id or req.task_id
        if not tid:
            raise e.InvalidParamsError(
                "taskId is required", fields=[{"field": "taskId", "description": "required"}]
            )
        # A2A 1.0 §3.1.7 lists only PushNotificationNotSupportedError and TaskNotFoundError for
        # CreateTaskPushNotificationConfig (unlike SubscribeToTask, §3.1.6, which refuses a
        # terminal task): a config for a task that has ended is stored and never fires.
        rec = await self._task(call, tid)
        try:
            view = await self.tasks.put_push_config(rec, push_request(req))
        except TaskError as exc:
            raise task_error(exc) from None
        return push_json(view)

    async def get_push_config(
        self, call: A2ACall, req: GetTaskPushNotificationConfigRequest
    ) -> dict[str, Any]:
        call.require(SCOPE_READ)
        rec = await self._task(call, req.task_id)
        try:
            return push_json(await self.tasks.push_config(rec, req.id))
        except TaskError as exc:
            raise task_error(exc) from None

    async def list_push_configs(
        self, call: A2ACall, req: ListTaskPushNotificationConfigsRequest
    ) -> dict[str, Any]:
        call.require(SCOPE_READ)
        rec = await self._task(call, req.task_id)
        configs = [push_json(v) for v in await self.tasks.push_configs(rec)]
        start = 0
        if req.page_token:
            try:
                start = int(req.page_token)
            except ValueError:
                raise e.InvalidParamsError(
                    "pageToken is not a token this server handed out",
                    fields=[{"field": "pageToken", "description": "unknown token"}],
                ) from None
        size = req.page_size or 100
        page = configs[start : start + size]
        nxt = str(start + size) if start + size < len(configs) else ""
        out: dict[str, Any] = {"configs": page}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    async def delete_push_config(
        self, call: A2ACall, req: DeleteTaskPushNotificationConfigRequest
    ) -> None:
        call.require(SCOPE_INVOKE)
        rec = await self._task(call, req.task_id)
        await self.tasks.delete_push_config(rec, req.id)

    # ---- cards ----------------------------------------------------------------------------
    async def extended_card(self, call: A2ACall) -> dict[str, Any]:
        call.require(SCOPE_READ)
        inst = call.instance
        profile = await self.tasks.profile(inst)
        details = {
            "instanceId": inst.id,
            "owner": inst.owner,
            "state": inst.state,
            "agent": "connected" if self.tasks.agent_ready(inst.id) else "disconnected",
            "loadout": inst.loadout or "",
            "image": inst.image or "",
            "host": inst.host or "",
            "sessionAttach": f"{self.settings.effective_public_url}/api/v2/admin/sessions/"
            "{sessionId}/attach",
            "skillProblems": list(profile.problems),
        }
        card = build_card(
            instance=inst,
            profile=profile,
            public_url=self.settings.effective_public_url,
            server_version=VERSION,
            extended=details,
            files_root=self.settings.task_files_root,
        )
        signed = await self.cards.signed(card, instance=inst, cache_key=None)
        result: dict[str, Any] = json.loads(signed.body)
        return result
