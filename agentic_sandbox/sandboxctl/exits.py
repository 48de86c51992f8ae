"""Exit codes, and the SDK's exceptions mapped onto them (documented in `sandboxctl --help`)."""

from __future__ import annotations

from typing import Any

from agentic_sandbox.sdk import (
    ApiError,
    Conflict,
    ConnectionFailed,
    Forbidden,
    NotFound,
    RateLimited,
    SandboxError,
    Unauthorized,
    Unavailable,
    UnknownContext,
    ValidationFailed,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_AUTH = 4
EXIT_CONFLICT = 5
EXIT_INVALID = 6
EXIT_UNAVAILABLE = 7

_BY_CLASS: tuple[tuple[type[SandboxError], int], ...] = (
    (UnknownContext, EXIT_USAGE),
    (ValidationFailed, EXIT_INVALID),
    (Unauthorized, EXIT_AUTH),
    (Forbidden, EXIT_AUTH),
    (NotFound, EXIT_NOT_FOUND),
    (Conflict, EXIT_CONFLICT),
    (RateLimited, EXIT_UNAVAILABLE),
    (Unavailable, EXIT_UNAVAILABLE),
    (ConnectionFailed, EXIT_UNAVAILABLE),
)


class CliError(Exception):
    """A failure of the CLI itself (bad arguments, a failed wait): its message and exit code."""

    def __init__(
        self, message: str, code: int = EXIT_ERROR, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.problem = problem or {}


def exit_code(exc: SandboxError) -> int:
    for cls, code in _BY_CLASS:
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR


def problem_of(exc: BaseException) -> dict[str, Any]:
    return exc.problem if isinstance(exc, ApiError | CliError) else {}
