"""Errors the fleet's services raise; the admin API maps each to one problem (`api/problems.py`).

The fleet's own errors (`agentic_sandbox.fleet.FleetError` and its kinds) pass through the
services unchanged: they are typed already, and mapped beside these.
"""

from __future__ import annotations


class InstanceError(Exception):
    """Base class: `message` is the whole human-readable detail."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFoundError(InstanceError):
    """Unknown, or invisible to the caller (the two are never told apart)."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} not found")
        self.kind = kind
        self.ident = ident


class ForbiddenError(InstanceError):
    """The caller sees the object but may not change it."""


class ConflictError(InstanceError):
    """The object's state forbids the change (it exists, is busy, is in use)."""

    def __init__(
        self, message: str, *, code: str | None = None, extra: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra or {}


class InvalidInput(InstanceError):
    """An input names something that cannot be used. `field` is the input's name (`image`,
    `loadout`, …); `summary`, when given, is the short message listed per field."""

    def __init__(
        self,
        field: str,
        detail: str,
        *,
        summary: str | None = None,
        code: str | None = None,
        extra: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail
        self.summary = summary
        self.code = code
        self.extra = extra or {}


class QuotaExceeded(InstanceError):
    """Too many instances for this owner; retry once one is deleted."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FleetUnavailable(InstanceError):
    """The fleet is disabled or not connected yet; retry later."""

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after
