"""RFC 7807 problem+json errors and the middleware that makes every API error one.

No API path ever answers with a traceback or HTML: unknown routes, wrong methods, oversized
bodies, validation failures and unexpected exceptions all become `application/problem+json`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from agentic_sandbox.broker.auth.streams import TooManyStreams
from agentic_sandbox.broker.observability.logs import correlation_id
from agentic_sandbox.broker.store.health import StorageFailure, storage_failure

log = logging.getLogger(__name__)

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_BASE = "https://agentic-sandbox.dev/problems/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProblemError(Exception):
    """Raise anywhere under a request to answer with a problem document."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        code: str | None = None,
        title: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(detail)
        self.close = close  # end the connection after answering (its request is unfinished)
        self.status = status
        self.detail = detail
        self.code = code or _default_code(status)
        self.title = title or HTTPStatus(status).phrase
        self.errors = errors
        self.headers = headers or {}
        self.extra = extra or {}


def _default_code(status: int) -> str:
    return {
        400: "bad-request",
        401: "unauthenticated",
        403: "forbidden",
        404: "not-found",
        405: "method-not-allowed",
        408: "body-timeout",
        409: "conflict",
        413: "payload-too-large",
        415: "unsupported-media-type",
        422: "invalid-input",
        429: "too-many-requests",
        500: "internal-error",
        503: "not-ready",
        507: "storage-full",
    }.get(status, "error")


def not_found(kind: str, ident: str) -> ProblemError:
    return ProblemError(404, f"{kind} {ident!r} not found", code=f"{kind}-not-found")


def conflict(detail: str, **kw: Any) -> ProblemError:
    return ProblemError(409, detail, **kw)


def unprocessable(detail: str, errors: list[dict[str, Any]] | None = None) -> ProblemError:
    return ProblemError(422, detail, errors=errors)


def too_many(detail: str, retry_after: int) -> ProblemError:
    return ProblemError(429, detail, headers={"Retry-After": str(max(1, retry_after))})


def not_ready(detail: str, retry_after: int = 5) -> ProblemError:
    return ProblemError(503, detail, headers={"Retry-After": str(retry_after)})


def storage_problem(failure: StorageFailure) -> ProblemError:
    """507 when the storage is full (nothing was stored; free space and retry), else 503."""
    if failure.kind == "full":
        return ProblemError(
            507,
            f"{failure.public}; nothing was stored — retry once an operator has freed space",
            code="storage-full",
        )
    return ProblemError(
        503,
        f"{failure.public}; nothing was stored",
        code="storage-unavailable",
        headers={"Retry-After": "30"},
    )


def validation_problem(exc: ValidationError, where: str = "body") -> ProblemError:
    """422 naming every bad field as `where.path.to.field`."""
    errors = []
    for err in exc.errors(include_url=False, include_context=False):
        loc = ".".join(str(p) for p in (where, *err["loc"]))
        errors.append({"field": loc, "message": err["msg"], "type": err["type"]})
    first = errors[0] if errors else {"field": where, "message": "invalid"}
    detail = f"{first['field']}: {first['message']}"
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more)"
    return ProblemError(422, detail, errors=errors)


def problem_response(request: web.Request | None, problem: ProblemError) -> web.Response:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + problem.code,
        "title": problem.title,
        "status": problem.status,
        "detail": problem.detail,
        "code": problem.code,
    }
    if request is not None:
        body["instance"] = request.path
    cid = correlation_id.get()
    if cid:
        body["request_id"] = cid
    if problem.errors:
        body["errors"] = problem.errors
    body.update(problem.extra)
    resp = web.Response(
        status=problem.status,
        text=json.dumps(body),
        content_type=PROBLEM_CONTENT_TYPE,
        headers=problem.headers,
    )
    if problem.close:
        resp.force_close()
    return resp


def _from_http_exception(exc: web.HTTPException) -> ProblemError:
    status = exc.status
    if status == 404:
        return ProblemError(404, "no such route", code="route-not-found")
    if status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return ProblemError(
            405, f"method not allowed; allowed: {allowed}", headers={"Allow": allowed}
        )
    if status == 413:
        return ProblemError(413, "request body too large", code="payload-too-large")
    reason = exc.reason or HTTPStatus(status).phrase
    return ProblemError(status, exc.text if exc.text and exc.text != reason else reason)


def is_api_path(path: str) -> bool:
    return path.startswith(("/api/", "/agents/", "/metrics", "/healthz", "/readyz"))


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProblemError as problem:
        return problem_response(request, problem)
    except ValidationError as exc:
        return problem_response(request, validation_problem(exc))
    except TooManyStreams as exc:
        return problem_response(
            request,
            ProblemError(429, str(exc), code="too-many-streams", headers={"Retry-After": "5"}),
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if not is_api_path(request.path) and exc.status == 404:
            raise
        return problem_response(request, _from_http_exception(exc))
    except Exception as exc:
        failure = storage_failure(exc)
        if failure is not None:
            log.error(
                "request failed for lack of storage: %s",
                failure.message,
                extra={"path": request.path, "method": request.method},
            )
            return problem_response(request, storage_problem(failure))
        log.exception("unhandled error", extra={"path": request.path, "method": request.method})
        return problem_response(
            request,
            ProblemError(500, "internal error; the server log has the details under request_id"),
        )
