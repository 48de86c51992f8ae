"""A2A 1.0 request objects (the protobuf JSON mapping of `lf.a2a.v1`), validated with pydantic.

Field names are camelCase on the wire; the proto names (snake_case) are accepted too, as the
protobuf JSON mapping requires. Enums are their names (`ROLE_USER`, `TASK_STATE_WORKING`).
Unknown fields are ignored (A2A 1.0 §5.7: implementations SHOULD ignore unrecognized fields);
everything else is checked, and an error names the field (`message.parts[0].text`).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from agentic_sandbox.broker.tasks import TaskState, parse_timestamp

MAX_ID = 128


class Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    def dump(self) -> dict[str, Any]:
        """Back to wire JSON (camelCase), without unset fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Part(Wire):
    text: str | None = None
    raw: str | None = Field(default=None, description="base64 bytes")
    url: str | None = Field(default=None, max_length=8192)
    data: Any = None
    metadata: dict[str, Any] | None = None
    filename: str | None = Field(default=None, max_length=1024)
    media_type: str | None = Field(default=None, max_length=255)

    @model_validator(mode="before")
    @classmethod
    def _one_content(cls, value: object) -> object:
        if isinstance(value, dict):
            kinds = [k for k in ("text", "raw", "url", "data") if value.get(k) is not None]
            if len(kinds) != 1:
                raise ValueError(
                    "a part has exactly one of text, raw, url or data"
                    + (f" (got {', '.join(kinds)})" if kinds else "")
                )
        return value

    @field_validator("raw")
    @classmethod
    def _b64(cls, value: str | None) -> str | None:
        if value is not None:
            std = value.replace("-", "+").replace("_", "/")
            try:
                base64.b64decode(std + "=" * (-len(std) % 4), validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("raw must be base64") from None
        return value

    def dump(self) -> dict[str, Any]:
        out = super().dump()
        if self.data is None:
            out.pop("data", None)
        return out


ROLES = {"ROLE_USER": "ROLE_USER", "ROLE_AGENT": "ROLE_AGENT", "1": "ROLE_USER", "2": "ROLE_AGENT"}


class Message(Wire):
    message_id: str = Field(min_length=1, max_length=MAX_ID)
    context_id: str | None = Field(default=None, max_length=64)
    task_id: str | None = Field(default=None, max_length=64)
    role: str
    parts: list[Part] = Field(min_length=1, max_length=100)
    metadata: dict[str, Any] | None = None
    extensions: list[str] | None = None
    reference_task_ids: list[str] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: object) -> str:
        key = str(value)
        if key not in ROLES:
            raise ValueError("role must be ROLE_USER or ROLE_AGENT")
        return ROLES[key]

    def dump(self) -> dict[str, Any]:
        out = super().dump()
        out["parts"] = [p.dump() for p in self.parts]
        for key in ("contextId", "taskId"):
            if not out.get(key):
                out.pop(key, None)
        for key in ("extensions", "referenceTaskIds", "metadata"):
            if not out.get(key):
                out.pop(key, None)
        return out


class AuthenticationInfo(Wire):
    scheme: str = Field(min_length=1, max_length=64)
    credentials: str | None = Field(default=None, max_length=4096)


class TaskPushNotificationConfig(Wire):
    tenant: str | None = None
    id: str | None = Field(default=None, max_length=64)
    task_id: str | None = Field(default=None, max_length=64)
    url: str = Field(min_length=1, max_length=2048)
    token: str | None = Field(default=None, max_length=1024)
    authentication: AuthenticationInfo | None = None


class SendMessageConfiguration(Wire):
    accepted_output_modes: list[str] | None = None
    task_push_notification_config: TaskPushNotificationConfig | None = None
    history_length: int | None = Field(default=None, ge=0, le=1_000_000)
    return_immediately: bool = False


class SendMessageRequest(Wire):
    tenant: str | None = None
    message: Message
    configuration: SendMessageConfiguration | None = None
    metadata: dict[str, Any] | None = None


class GetTaskRequest(Wire):
    tenant: str | None = None
    id: str = Field(min_length=1, max_length=64)
    history_length: int | None = Field(default=None, ge=0, le=1_000_000)


class ListTasksRequest(Wire):
    tenant: str | None = None
    context_id: str | None = Field(default=None, max_length=64)
    status: TaskState | None = None
    page_size: int | None = Field(default=None, ge=1, le=100)
    page_token: str | None = Field(default=None, max_length=400)
    history_length: int | None = Field(default=None, ge=0, le=1_000_000)
    status_timestamp_after: dt.datetime | None = None
    include_artifacts: bool = False

    @field_validator("status", mode="before")
    @classmethod
    def _state(cls, value: object) -> TaskState | None:
        if value in (None, "", "TASK_STATE_UNSPECIFIED", 0, "0"):
            return None
        if isinstance(value, str):
            try:
                return TaskState.from_wire(value)
            except ValueError:
                raise ValueError(
                    "status must be a TaskState name such as TASK_STATE_WORKING"
                ) from None
        raise ValueError("status must be a TaskState name such as TASK_STATE_WORKING")

    @field_validator("status_timestamp_after", mode="before")
    @classmethod
    def _stamp(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return parse_timestamp(value)
            except ValueError:
                raise ValueError(
                    "must be an RFC 3339 timestamp such as 2025-01-01T00:00:00Z"
                ) from None
        return value


class CancelTaskRequest(Wire):
    tenant: str | None = None
    id: str = Field(min_length=1, max_length=64)
    metadata: dict[str, Any] | None = None


class SubscribeToTaskRequest(Wire):
    tenant: str | None = None
    id: str = Field(min_length=1, max_length=64)


class GetTaskPushNotificationConfigRequest(Wire):
    tenant: str | None = None
    task_id: str = Field(min_length=1, max_length=64)
    id: str = Field(min_length=1, max_length=64)


class DeleteTaskPushNotificationConfigRequest(GetTaskPushNotificationConfigRequest):
    pass


class ListTaskPushNotificationConfigsRequest(Wire):
    tenant: str | None = None
    task_id: str = Field(min_length=1, max_length=64)
    page_size: int | None = Field(default=None, ge=0, le=100)
    page_token: str | None = Field(default=None, max_length=400)


class GetExtendedAgentCardRequest(Wire):
    tenant: str | None = None


def error_fields(exc: ValidationError, prefix: str = "") -> list[dict[str, str]]:
    """`[{field, description}]` with wire names: `message.parts[0].text`."""
    out = []
    for err in exc.errors(include_url=False, include_context=False):
        path = prefix
        for loc in err["loc"]:
            if isinstance(loc, int):
                path += f"[{loc}]"
            elif loc in ("function-after", "function-before"):
                continue
            else:
                path += ("." if path else "") + str(loc)
        out.append({"field": path or "params", "description": err["msg"]})
    return out


__all__ = [
    "CancelTaskRequest",
    "DeleteTaskPushNotificationConfigRequest",
    "GetExtendedAgentCardRequest",
    "GetTaskPushNotificationConfigRequest",
    "GetTaskRequest",
    "ListTaskPushNotificationConfigsRequest",
    "ListTasksRequest",
    "Message",
    "Part",
    "SendMessageConfiguration",
    "SendMessageRequest",
    "SubscribeToTaskRequest",
    "TaskPushNotificationConfig",
    "error_fields",
]
