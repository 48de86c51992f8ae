"""Errors the task layer raises; each surface (A2A, v1, admin) maps them to its own format."""

from __future__ import annotations


class TaskError(Exception):
    """Base class. `field` names the offending input when there is one."""

    def __init__(self, message: str, *, field: str | None = None, **detail: object) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.detail = detail


class TaskNotFound(TaskError):
    """Unknown task, or one the caller may not see (the two are never told apart)."""


class TaskNotCancelable(TaskError):
    """The task is already in a terminal state."""


class TaskNotWaiting(TaskError):
    """A follow-up message for a task that is not waiting for input (or is terminal)."""


class InvalidTaskInput(TaskError):
    """The request is malformed in a way no task could be made of (not a rejection)."""


class IdempotencyConflict(TaskError):
    """The same messageId was used before with different content."""


class QuotaExceeded(TaskError):
    """Too many pending tasks (globally or for this owner); retry later."""

    def __init__(
        self, message: str, *, retry_after: int = 5, field: str | None = None, **detail: object
    ) -> None:
        super().__init__(message, field=field, **detail)
        self.retry_after = retry_after


class PushConfigNotFound(TaskError):
    pass


class InvalidPushConfig(TaskError):
    pass


class UnsupportedContent(TaskError):
    """A part this agent cannot take (files: `raw`, `url`)."""
