"""Structured JSON logs with correlation ids, and a redactor that keeps secrets out of them.

The correlation id is a context variable: the HTTP middleware sets it per request (from a valid
`X-Request-Id` or a fresh one), task execution sets it per task, and every log line, event and
audit entry written in that context carries it.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import re
import sys
import threading
import uuid
from collections.abc import Iterable
from typing import Any

correlation_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "correlation_id", default=None
)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{8,64}$")


def new_correlation_id() -> str:
    return uuid.uuid4().hex


def accept_request_id(value: str | None) -> str:
    """Use a caller's request id when it is well-formed, else mint one."""
    if value and _REQUEST_ID_RE.match(value):
        return value
    return new_correlation_id()


class Redactor:
    """Replaces registered secret values with `***` wherever text is emitted.

    Secrets are registered when they are written or decrypted; only values of at least 4
    characters are redacted (shorter ones would mangle ordinary text).
    """

    MASK = "***"

    def __init__(self) -> None:
        self._values: set[str] = set()
        self._bytes: list[bytes] = []
        self._pattern: re.Pattern[str] | None = None
        self._lock = threading.Lock()

    def add(self, values: Iterable[str]) -> None:
        with self._lock:
            changed = False
            for v in values:
                if len(v) >= 4 and v not in self._values:
                    self._values.add(v)
                    changed = True
            if changed:
                ordered = sorted(self._values, key=len, reverse=True)
                self._pattern = re.compile("|".join(re.escape(v) for v in ordered))
                self._bytes = [v.encode() for v in ordered]

    def remove(self, values: Iterable[str]) -> None:
        with self._lock:
            for v in values:
                self._values.discard(v)
            ordered = sorted(self._values, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(v) for v in ordered)) if ordered else None
            self._bytes = [v.encode() for v in ordered]

    def text(self, value: str) -> str:
        pattern = self._pattern
        if pattern is None:
            return value
        return pattern.sub(self.MASK, value)

    def data(self, value: Any) -> Any:
        """Redact strings inside JSON-like data."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.data(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(v) for v in value]
        return value


redactor = Redactor()

_STD_ATTRS = frozenset(
    vars(logging.LogRecord("x", 0, "x", 0, "x", None, None)).keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        cid = getattr(record, "correlation_id", None) or correlation_id.get()
        if cid:
            entry["correlation_id"] = cid
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and key != "correlation_id" and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return redactor.text(json.dumps(entry, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        cid = correlation_id.get()
        if cid:
            line += f" [cid={cid}]"
        return redactor.text(line)


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiohttp.access", "alembic", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
