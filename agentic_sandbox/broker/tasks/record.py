"""A task as the server holds it, and its A2A 1.0 JSON form (Task, Message, events).

Tasks *are* A2A tasks: the history, status messages and artifacts are kept in A2A 1.0 JSON
(camelCase, `ROLE_*`, `TASK_STATE_*`, parts `text`/`raw`/`url`/`data`), so streams, push
notifications and every binding emit exactly what was stored.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks.states import TaskState

OUTPUT_ARTIFACT_ID = "output"
OUTPUT_ARTIFACT_NAME = "terminal output"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def timestamp(value: dt.datetime) -> str:
    """google.protobuf.Timestamp JSON: RFC 3339 in UTC with a `Z`, millisecond precision."""
    return value.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_timestamp(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("timestamp needs a timezone (use Z for UTC)")
    return value.astimezone(dt.UTC)


def agent_message(task_id: str, context_id: str, text: str) -> dict[str, Any]:
    return {
        "messageId": str(uuid.uuid4()),
        "contextId": context_id,
        "taskId": task_id,
        "role": "ROLE_AGENT",
        "parts": [{"text": text}],
    }


@dataclass
class TaskRecord:
    """One task; the in-memory mirror of a `tasks` row."""

    id: str
    instance_id: str
    owner: str
    context_id: str
    state: TaskState
    incarnation: str | None = None  # of the instance the task was sent to
    skill: str | None = None
    message_id: str | None = None
    status_message: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)  # the output artifact's text, in pieces
    file_artifacts: list[dict[str, Any]] = field(default_factory=list)  # outbox files
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: dt.datetime = field(default_factory=utcnow)
    updated_at: dt.datetime = field(default_factory=utcnow)
    status_at: dt.datetime = field(default_factory=utcnow)
    version: int = 1

    # ---- conversion -----------------------------------------------------------------------
    @classmethod
    def from_row(cls, row: m.Task, output_text: str | None = None) -> TaskRecord:
        """From a row; `output_text` overrides the stored artifact (active tasks keep their
        output as appended `task_events` until they end)."""
        output: list[str] = [output_text] if output_text else []
        files: list[dict[str, Any]] = []  # outbox files (tasks/files.py)
        for art in row.artifacts or []:
            if art.get("artifactId") != OUTPUT_ARTIFACT_ID:
                files.append(art)
            elif output_text is None:
                output = ["".join(p.get("text", "") for p in art.get("parts", []))]
        return cls(
            id=row.id,
            instance_id=row.instance_id,
            incarnation=row.incarnation,
            owner=row.owner,
            context_id=row.context_id,
            state=TaskState(row.state),
            skill=row.skill,
            message_id=row.message_id,
            status_message=row.status_message,
            history=list(row.history or []),
            output=output,
            file_artifacts=files,
            metadata=dict(row.task_metadata or {}),
            created_at=row.created_at,
            updated_at=row.updated_at,
            status_at=row.status_at,
            version=row.version,
        )

    def output_text(self) -> str:
        if len(self.output) > 1:  # join lazily, once per change
            self.output[:] = ["".join(self.output)]
        return self.output[0] if self.output else ""

    def artifacts(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.output:
            out.append(
                {
                    "artifactId": OUTPUT_ARTIFACT_ID,
                    "name": OUTPUT_ARTIFACT_NAME,
                    "parts": [{"text": self.output_text()}],
                }
            )
        return out + self.file_artifacts

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.wire, "timestamp": timestamp(self.status_at)}
        if self.status_message is not None:
            out["message"] = self.status_message
        return out

    def to_a2a(
        self, *, history_length: int | None = None, include_artifacts: bool = True
    ) -> dict[str, Any]:
        """The A2A `Task` object. `history_length`: None all, 0 none, n the last n."""
        task: dict[str, Any] = {
            "id": self.id,
            "contextId": self.context_id,
            "status": self.status(),
        }
        if include_artifacts:
            arts = self.artifacts()
            if arts:
                task["artifacts"] = arts
        if history_length is None:
            history = self.history
        elif history_length == 0:
            history = []
        else:
            history = self.history[-history_length:]
        if history:
            task["history"] = list(history)
        if self.metadata:
            task["metadata"] = dict(self.metadata)
        return task

    # ---- events ---------------------------------------------------------------------------
    def status_event(self) -> dict[str, Any]:
        """A StreamResponse carrying a TaskStatusUpdateEvent of the current status."""
        return {
            "statusUpdate": {
                "taskId": self.id,
                "contextId": self.context_id,
                "status": self.status(),
            }
        }

    def artifact_event(self, text: str, *, append: bool, last_chunk: bool) -> dict[str, Any]:
        """A StreamResponse carrying a TaskArtifactUpdateEvent with one output chunk."""
        event: dict[str, Any] = {
            "taskId": self.id,
            "contextId": self.context_id,
            "artifact": {
                "artifactId": OUTPUT_ARTIFACT_ID,
                "name": OUTPUT_ARTIFACT_NAME,
                "parts": [{"text": text}],
            },
        }
        if append:
            event["append"] = True
        if last_chunk:
            event["lastChunk"] = True
        return {"artifactUpdate": event}

    def task_event(self, *, history_length: int | None = None) -> dict[str, Any]:
        return {"task": self.to_a2a(history_length=history_length)}
