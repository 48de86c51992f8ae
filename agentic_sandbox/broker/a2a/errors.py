"""A2A 1.0 errors and their two wire forms.

Every error carries a `google.rpc.ErrorInfo` detail (`reason` such as `TASK_NOT_FOUND`,
`domain: a2a-protocol.org`, `metadata`); invalid input also carries a `google.rpc.BadRequest`
with one field violation per bad field.

- JSON-RPC: `{"jsonrpc": "2.0", "id": …, "error": {"code": -32001, "message": …,
  "data": [ErrorInfo, BadRequest?]}}`, HTTP 200 (HTTP 401/403 for missing or refused
  credentials).
- HTTP+JSON: `{"error": {"code": <http status>, "status": "NOT_FOUND", "message": …,
  "details": [ErrorInfo, BadRequest?]}}` with that HTTP status (google.rpc.Status / AIP-193).

Codes and HTTP statuses follow the A2A 1.0 error mapping table (§5.4).
"""

from __future__ import annotations

from typing import Any

ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest"
A2A_DOMAIN = "a2a-protocol.org"
OUR_DOMAIN = "agentic-sandbox.dev"

RequestId = str | int | None  # a JSON-RPC request id (never a bool, a float or a structure)


class A2AError(Exception):
    """Base: `code` (JSON-RPC), `http` status, gRPC `status` name and ErrorInfo `reason`."""

    code = -32603
    http = 500
    status = "INTERNAL"
    reason = "INTERNAL_ERROR"
    domain = A2A_DOMAIN
    default_message = "internal error"

    def __init__(
        self,
        message: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        fields: list[dict[str, str]] | None = None,
        headers: dict[str, str] | None = None,
        http: int | None = None,
    ) -> None:
        self.message = message or self.default_message
        super().__init__(self.message)
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.fields = fields or []
        self.headers = headers or {}
        if http is not None:
            self.http = http

    def details(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {
                "@type": ERROR_INFO,
                "reason": self.reason,
                "domain": self.domain,
                "metadata": self.metadata,
            }
        ]
        if self.fields:
            out.append({"@type": BAD_REQUEST, "fieldViolations": self.fields})
        return out

    def jsonrpc(self, request_id: RequestId) -> dict[str, Any]:
        return {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": {"code": self.code, "message": self.message, "data": self.details()},
        }

    def rest(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.http,
                "status": self.status,
                "message": self.message,
                "details": self.details(),
            }
        }


class TaskNotFoundError(A2AError):
    code, http, status, reason = -32001, 404, "NOT_FOUND", "TASK_NOT_FOUND"
    default_message = "task not found"


class TaskNotCancelableError(A2AError):
    code, http, status, reason = -32002, 409, "FAILED_PRECONDITION", "TASK_NOT_CANCELABLE"
    default_message = "task cannot be canceled"


class PushNotificationNotSupportedError(A2AError):
    code, http, status = -32003, 400, "UNIMPLEMENTED"
    reason = "PUSH_NOTIFICATION_NOT_SUPPORTED"
    default_message = "push notifications are not supported"


class UnsupportedOperationError(A2AError):
    code, http, status, reason = -32004, 400, "UNIMPLEMENTED", "UNSUPPORTED_OPERATION"
    default_message = "this operation is not supported"


class ContentTypeNotSupportedError(A2AError):
    code, http, status = -32005, 415, "INVALID_ARGUMENT"
    reason = "CONTENT_TYPE_NOT_SUPPORTED"
    default_message = "content type not supported"


class InvalidAgentResponseError(A2AError):
    code, http, status, reason = -32006, 502, "INTERNAL", "INVALID_AGENT_RESPONSE"
    default_message = "invalid agent response"


class ExtendedAgentCardNotConfiguredError(A2AError):
    code, http, status = -32007, 400, "FAILED_PRECONDITION"
    reason = "EXTENDED_AGENT_CARD_NOT_CONFIGURED"
    default_message = "no extended agent card is configured"


class ExtensionSupportRequiredError(A2AError):
    code, http, status = -32008, 400, "FAILED_PRECONDITION"
    reason = "EXTENSION_SUPPORT_REQUIRED"
    default_message = "a required extension is not declared"


class VersionNotSupportedError(A2AError):
    code, http, status, reason = -32009, 400, "UNIMPLEMENTED", "VERSION_NOT_SUPPORTED"
    default_message = "A2A version not supported"


class JSONParseError(A2AError):
    code, http, status, reason = -32700, 400, "INVALID_ARGUMENT", "INVALID_REQUEST"
    default_message = "invalid JSON payload"


class InvalidRequestError(A2AError):
    code, http, status, reason = -32600, 400, "INVALID_ARGUMENT", "INVALID_REQUEST"
    default_message = "invalid request"


class MethodNotFoundError(A2AError):
    code, http, status, reason = -32601, 404, "NOT_FOUND", "METHOD_NOT_FOUND"
    default_message = "method not found"


class InvalidParamsError(A2AError):
    code, http, status, reason = -32602, 400, "INVALID_ARGUMENT", "INVALID_PARAMS"
    default_message = "invalid parameters"


class InternalError(A2AError):
    pass


class UnauthenticatedError(A2AError):
    """No usable credential (HTTP 401 on both bindings)."""

    code, http, status, reason, domain = (
        -32000,
        401,
        "UNAUTHENTICATED",
        "UNAUTHENTICATED",
        OUR_DOMAIN,
    )
    default_message = "a valid API key or operator token is required (Authorization: Bearer)"


class PermissionDeniedError(A2AError):
    """The credential is valid but may not do this (HTTP 403 on both bindings)."""

    code, http, status, reason, domain = (
        -32000,
        403,
        "PERMISSION_DENIED",
        "PERMISSION_DENIED",
        OUR_DOMAIN,
    )
    default_message = "permission denied"


class QuotaExceededError(A2AError):
    """Rate or quota refusal outside a task (HTTP 429)."""

    code, http, status, reason, domain = (
        -32000,
        429,
        "RESOURCE_EXHAUSTED",
        "RESOURCE_EXHAUSTED",
        OUR_DOMAIN,
    )
    default_message = "too many requests"


# Errors that are answered with their own HTTP status on the JSON-RPC binding too.
TRANSPORT_LEVEL = (UnauthenticatedError, PermissionDeniedError)
