"""What an event is: its fields and `seq`, the families of types, and the filter that selects
events (the same filter runs over the ring, live subscribers and, as SQL, the event log)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

EVENT_TYPE_PREFIXES = (
    "instance.",
    "agent.",
    "session.",
    "task.",
    "host.",
    "image.",
    "auth.",
    "operation.",
    "stream.",
    "egress.",
    "cluster.",
)

# The optional subject fields of an event, which filters and the log's columns share.
SUBJECT_FIELDS = ("owner", "instance_id", "session_id", "task_id", "host")


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    time: dt.datetime
    actor: str | None = None
    instance_id: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    host: str | None = None
    correlation_id: str | None = None
    owner: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "type": self.type, "time": self.time.isoformat()}
        for key in (
            "actor",
            "instance_id",
            "session_id",
            "task_id",
            "host",
            "correlation_id",
            "owner",
        ):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["data"] = self.data
        return out


@dataclass(frozen=True)
class EventFilter:
    owner: str | None = None  # non-admins see only events about what they own
    types: tuple[str, ...] = ()  # exact names or prefixes ending in `*` / `.`
    instance_id: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    host: str | None = None

    def matches(self, ev: Event) -> bool:
        if self.types and not any(type_matches(t, ev.type) for t in self.types):
            return False
        for key in SUBJECT_FIELDS:
            want = getattr(self, key)
            if want is not None and getattr(ev, key) != want:
                return False
        return True


def type_prefix(pattern: str) -> str | None:
    """The prefix a type pattern stands for (`instance.*`, `instance.`), None for an exact name."""
    if pattern.endswith("*"):
        return pattern[:-1]
    if pattern.endswith("."):
        return pattern
    return None


def type_matches(pattern: str, value: str) -> bool:
    prefix = type_prefix(pattern)
    return value == pattern if prefix is None else value.startswith(prefix)
