"""Exceptions: every refusal of the server is a `SandboxError` built from its problem+json.

    try:
        client.instances.get("nope")
    except NotFound as exc:
        exc.status, exc.code, exc.detail      # 404, "instance-not-found", "instance 'nope' ..."
    except ValidationFailed as exc:
        exc.fields                            # {"body.id": "String should match pattern ..."}
    except RateLimited as exc:
        exc.retry_after                       # seconds, from Retry-After

The class follows the HTTP status; `problem` is the server's whole document.
"""

from __future__ import annotations

import json
from typing import Any


class SandboxError(Exception):
    """Anything the SDK raises on purpose."""


class ConfigError(SandboxError):
    """The client's own configuration is wrong (unknown context, unreadable token file)."""


class ConnectionFailed(SandboxError):
    """The server could not be reached (refused, DNS, TLS), or the connection broke."""


class RedirectRefused(SandboxError):
    """A server redirected to an origin this client was not given (nor told of as the leader
    by a node it was given), or redirected too often; the request was not re-sent."""


class ApiError(SandboxError):
    """The server refused a request: its status and problem document."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        problem: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.problem: dict[str, Any] = dict(problem or {})
        self.detail = detail
        self.code: str = str(self.problem.get("code") or "")
        self.retry_after = retry_after
        super().__init__(self._message())

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The problem's field errors, `[{field, message, type}]` (empty for most refusals)."""
        items = self.problem.get("errors")
        return [e for e in items if isinstance(e, dict)] if isinstance(items, list) else []

    @property
    def fields(self) -> dict[str, str]:
        """Bad field → its message, e.g. `{"body.id": "String should match pattern …"}`."""
        return {str(e.get("field")): str(e.get("message", "")) for e in self.errors}

    def _message(self) -> str:
        rest = self.errors[1:]
        return self.detail + "".join(f"\n  {e.get('field')}: {e.get('message')}" for e in rest)


class ValidationFailed(ApiError):
    """400, 413, 415 or 422: the request was malformed or a field was invalid (see `fields`)."""


class Unauthorized(ApiError):
    """401: no token, or an invalid, expired or revoked one."""


class Forbidden(ApiError):
    """403: the token's role or ownership does not allow this."""


class NotFound(ApiError):
    """404: unknown, or not visible to this token."""


class Conflict(ApiError):
    """409: the object's state does not allow this now, or it exists already."""


class RateLimited(ApiError):
    """429: a rate limit or quota; `retry_after` says when to try again."""


class ServerError(ApiError):
    """5xx: the server failed or is not ready (503 carries `retry_after`)."""


class Unavailable(ServerError):
    """503: not ready (the fleet is disabled or connecting, storage unavailable, …)."""


class OperationFailed(SandboxError):
    """A long-running operation ended failed or canceled; `operation` is its last state."""

    def __init__(self, operation: Any) -> None:
        self.operation = operation
        error = operation.error or {}
        self.stage: str | None = error.get("stage") or operation.stage
        self.cause: str = str(error.get("cause") or operation.state)
        what = "was canceled" if operation.state == "canceled" else "failed"
        where = f" at stage {self.stage}" if self.stage else ""
        subject = f"{operation.kind} {operation.subject_id}".strip()
        super().__init__(f"{subject} {what}{where}: {self.cause}")


class SignatureInvalid(SandboxError):
    """An AgentCard's signature does not verify against its instance's published keys."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: ValidationFailed,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: ValidationFailed,
    415: ValidationFailed,
    422: ValidationFailed,
    429: RateLimited,
    503: Unavailable,
}


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare enough to ignore


def from_response(status: int, body: bytes, retry_after: str | None = None) -> ApiError:
    """The exception for a refusal: the class from the status, the text from problem+json."""
    doc: Any = None
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        pass
    if isinstance(doc, dict):
        detail = str(doc.get("detail") or doc.get("title") or f"HTTP {status}")
        problem: dict[str, Any] = doc
    else:
        text = body[:200].decode(errors="replace").strip()
        detail = f"HTTP {status}" + (f": {text}" if text else "")
        problem = {}
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    return cls(status, detail, problem=problem, retry_after=_retry_after(retry_after))
