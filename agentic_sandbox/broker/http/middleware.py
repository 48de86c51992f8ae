"""Request pipeline: correlation id → metrics → authentication → rate limit → problems.

Authentication accepts, in order: `Authorization: Bearer <token>`, the WebSocket subprotocol
`bearer.<token>` (browsers cannot set headers on a WebSocket), and the dashboard cookie (a
mutating request with the cookie needs `X-CSRF-Token`). A present-but-invalid credential is a
401 on any route; an A2A API key is a credential only under `/agents/` (403 elsewhere, whatever
the route). Every refusal is counted and goes through the refusal gate (`auth/refusals.py`):
audited once per window and key, and past an address's allowance answered 429.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from agentic_sandbox.broker.auth.credentials import same
from agentic_sandbox.broker.auth.refusals import Refusal, Verdict
from agentic_sandbox.broker.http.problems import ProblemError, problem_response
from agentic_sandbox.broker.http.routing import AUTH_ERROR, CSRF_TOKEN, DENIED_REASON, PRINCIPAL_KEY
from agentic_sandbox.broker.observability.logs import accept_request_id, correlation_id
from agentic_sandbox.broker.services import services

log = logging.getLogger("broker.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SESSION_COOKIE = "sbx_session"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
A2A_PREFIX = "/agents/"  # the only place an A2A API key is a credential


def route_label(request: web.Request) -> str:
    """The route template (bounded), never the concrete path."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None) if route is not None else None
    if resource is None:
        return "unmatched"
    canonical: str = resource.canonical
    return canonical if canonical else "unmatched"


def websocket_bearer(request: web.Request) -> str | None:
    header = request.headers.get("Sec-WebSocket-Protocol", "")
    for proto in header.split(","):
        proto = proto.strip()
        if proto.startswith("bearer."):
            return proto[len("bearer.") :]
    return None


@web.middleware
async def request_context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    cid = accept_request_id(request.headers.get("X-Request-Id"))
    token = correlation_id.set(cid)
    started = time.perf_counter()
    svc = services(request)
    status = 500
    try:
        response = await handler(request)
        if response.status in (401, 403) and not response.prepared:
            response = _refused(request, response)
        status = response.status
        if not response.prepared:
            response.headers["X-Request-Id"] = cid
        return response
    except web.HTTPException as exc:
        status = exc.status
        if status in (401, 403):
            _refusal_verdict(request, status)
        exc.headers["X-Request-Id"] = cid
        raise
    finally:
        elapsed = time.perf_counter() - started
        route = route_label(request)
        svc.metrics.http_requests.labels(route, request.method, str(status)).inc()
        svc.metrics.http_duration.labels(route, request.method).observe(elapsed)
        log.info(
            "%s %s %s %.1fms",
            request.method,
            request.path,
            status,
            elapsed * 1000,
            extra={
                "method": request.method,
                "path": request.path,
                "status": status,
                "ms": round(elapsed * 1000, 2),
                "remote": request.remote,
            },
        )
        correlation_id.reset(token)


def _refused(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Count and audit a 401/403 through the refusal gate; past an anonymous address's
    allowance the answer becomes 429 (and the refusal is only counted)."""
    verdict = _refusal_verdict(request, response.status)
    if not verdict.limited:
        return response
    services(request).metrics.rate_limited.inc()
    retry = max(1, math.ceil(verdict.retry_after))
    return problem_response(
        request,
        ProblemError(
            429,
            "too many refused requests from your address; retry later with a valid credential",
            code="rate-limited",
            headers={"Retry-After": str(retry)},
        ),
    )


def _refusal_verdict(request: web.Request, status: int) -> Verdict:
    svc = services(request)
    principal = request.get(PRINCIPAL_KEY)
    reason = (
        request.get(DENIED_REASON)
        or request.get(AUTH_ERROR)
        or ("no credentials" if status == 401 else "forbidden")
    )
    kind = "unauthenticated" if status == 401 else "forbidden"
    svc.metrics.auth_failures.labels(kind).inc()
    remote = request.remote or "unknown"
    route = route_label(request)
    if principal is None:
        actor, key = f"anonymous@{remote}", f"address:{remote}"
    else:
        actor, key = principal.actor, f"credential:{principal.credential_id}"
    refusal = Refusal(
        actor=actor,
        action=f"{request.method} {route}",
        subject_type="route",
        subject_id=request.path[:256],
        reason=reason,
        event="auth.denied",
        data={"status": status, "method": request.method, "route": route, "reason": reason},
    )
    return svc.refusals.refuse(key, refusal, limit=principal is None)


async def credential_still_valid(request: web.Request) -> bool:
    """Whether the credential this request came with is still usable (re-read from the store,
    within the auth cache's few seconds): a follower's long stream asks it now and then,
    since a revocation on the leader cannot end this node's streams itself."""
    svc = services(request)
    header = request.headers.get("Authorization")
    bearer = header.partition(" ")[2].strip() if header else websocket_bearer(request)
    if bearer:
        return await svc.auth.resolve_bearer(bearer) is not None
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        return False
    return await svc.auth.resolve_cookie(cookie) is not None


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    svc = services(request)
    bearer: str | None = None
    header = request.headers.get("Authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            request[AUTH_ERROR] = "malformed Authorization header"
            raise ProblemError(401, "Authorization must be 'Bearer <token>'")
        bearer = value.strip()
    else:
        bearer = websocket_bearer(request)

    if bearer is not None:
        principal = await svc.auth.resolve_bearer(bearer)
        if principal is None:
            request[AUTH_ERROR] = "invalid, expired or revoked token"
            raise ProblemError(
                401,
                "the token is invalid, expired or revoked",
                code="invalid-token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        request[PRINCIPAL_KEY] = principal
    else:
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            resolved = await svc.auth.resolve_cookie(cookie)
            if resolved is not None:
                principal, csrf = resolved
                if request.method not in SAFE_METHODS and not _csrf_ok(request, csrf):
                    request[AUTH_ERROR] = "missing or wrong CSRF token"
                    raise ProblemError(
                        403,
                        f"a cookie-authenticated change needs the {CSRF_HEADER} header",
                        code="csrf",
                    )
                request[PRINCIPAL_KEY] = principal
                request[CSRF_TOKEN] = csrf

    principal = request.get(PRINCIPAL_KEY)
    if principal is not None and principal.kind == "apikey" and not _on_a2a_surface(request):
        request[DENIED_REASON] = "A2A API key used outside /agents/"
        raise ProblemError(
            403,
            "A2A API keys are valid only on their instance's A2A surface "
            "(/agents/{instance_id}/); use an operator token here",
            code="forbidden-credential",
        )
    if principal is not None:
        wait = svc.ratelimit.take(principal.credential_id)
        if wait > 0:
            svc.metrics.rate_limited.inc()
            raise ProblemError(
                429,
                "rate limit exceeded for this token",
                code="rate-limited",
                headers={"Retry-After": str(int(wait) + 1)},
            )
    return await handler(request)


def _on_a2a_surface(request: web.Request) -> bool:
    return request.path.startswith(A2A_PREFIX)


def _csrf_ok(request: web.Request, expected: str) -> bool:
    given = request.headers.get(CSRF_HEADER, "")
    return bool(given) and same(given, expected)


@web.middleware
async def security_headers_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if not response.prepared:
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        if response.content_type == "text/html":
            response.headers.setdefault("X-Frame-Options", "DENY")
            response.headers.setdefault(
                "Content-Security-Policy",
                "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
                "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
            )
    return response
