"""What both bindings do before and after the handler: resolve the caller and the agent,
enforce `A2A-Version`, read JSON bodies, and write Server-Sent Events."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, JsonValue, ValidationError

from agentic_sandbox.broker.a2a import errors as e
from agentic_sandbox.broker.a2a import models as w
from agentic_sandbox.broker.a2a.handler import A2ACall, A2AHandler
from agentic_sandbox.broker.auth.streams import TooManyStreams
from agentic_sandbox.broker.http.body import BodyError, read_json_body
from agentic_sandbox.broker.http.routing import current_principal
from agentic_sandbox.broker.http.sse import EventStream
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.store.health import storage_failure
from agentic_sandbox.broker.tasks import TaskStream

log = logging.getLogger(__name__)

VERSION_HEADER = "A2A-Version"
SUPPORTED = (1, 0)
JSON_TYPES = ("application/json", "application/a2a+json")
A2A_JSON = "application/a2a+json"
INSTANCE_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

HANDLER = web.AppKey("a2a_handler", A2AHandler)
M = TypeVar("M", bound=BaseModel)


def check_version(request: web.Request) -> None:
    raw = request.headers.get(VERSION_HEADER, "").strip()
    if not raw:
        raise e.VersionNotSupportedError(
            f"the {VERSION_HEADER} header is required; this agent speaks A2A 1.0",
            metadata={"supportedVersions": "1.0"},
        )
    parts = raw.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        major, minor = -1, -1
    if (major, minor) != SUPPORTED:
        raise e.VersionNotSupportedError(
            f"A2A version {raw!r} is not supported; this agent speaks 1.0",
            metadata={"requestedVersion": raw[:32], "supportedVersions": "1.0"},
        )


async def resolve(request: web.Request) -> A2ACall:
    """Caller, then version, then the agent: 401, VersionNotSupported, not found / 403."""
    principal = current_principal(request)
    if principal is None:
        raise e.UnauthenticatedError(headers={"WWW-Authenticate": 'Bearer realm="a2a"'})
    check_version(request)
    iid = request.match_info["instance_id"]
    handler = request.app[HANDLER]
    instance = await handler.tasks.instance(iid) if INSTANCE_ID.match(iid) else None
    if instance is None or not (principal.is_admin or instance.owner == principal.subject):
        if principal.kind == "apikey" and principal.instance_id == iid and instance is not None:
            pass  # a key bound to this instance acts for its owner's agent
        else:
            raise e.TaskNotFoundError(
                f"no agent {iid!r} here (unknown instance, or not yours)",
                metadata={"instanceId": iid},
            )
    if principal.kind == "apikey" and principal.instance_id != iid:
        raise e.PermissionDeniedError(
            f"this API key is bound to instance {principal.instance_id!r}, not {iid!r}"
        )
    return A2ACall(instance=instance, principal=principal)


def parse_params(model: type[M], values: dict[str, Any]) -> M:
    """A request message from its JSON values, or `InvalidParamsError` naming every field."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        fields = w.error_fields(exc)
        raise e.InvalidParamsError(
            f"{fields[0]['field']}: {fields[0]['description']}"
            + (f" (and {len(fields) - 1} more)" if len(fields) > 1 else ""),
            fields=fields,
        ) from None


async def read_json(request: web.Request) -> JsonValue:
    """The decoded body (None when empty); see `http/body.py` for the limits."""
    ctype = request.content_type
    if ctype not in JSON_TYPES:
        raise e.InvalidRequestError(
            f"Content-Type must be application/json or application/a2a+json (got "
            f"{ctype or 'none'})",
            http=415,
        )
    try:
        _, doc = await read_json_body(request, services(request).settings.http_body_timeout_seconds)
    except BodyError as exc:
        if exc.status == 400:
            raise e.JSONParseError(exc.message) from None
        raise e.InvalidRequestError(exc.message, http=exc.status) from None
    return doc


def media_type(request: web.Request) -> str:
    if A2A_JSON in request.headers.get("Accept", "") or request.content_type == A2A_JSON:
        return A2A_JSON
    return "application/json"


def json_response(
    request: web.Request, body: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
        content_type=media_type(request),
        headers=headers,
    )


def unexpected(exc: BaseException) -> e.A2AError:
    """Never a stack trace to a client: log it, answer an InternalError with the request id
    (507/503 naming the problem when the server's storage refused the write)."""
    from agentic_sandbox.broker.observability.logs import correlation_id

    failure = storage_failure(exc)
    if failure is not None:
        log.error("A2A request failed for lack of storage: %s", failure.message)
        return e.InternalError(
            f"{failure.public}; nothing was stored",
            http=507 if failure.kind == "full" else 503,
            metadata={"storage": failure.kind},
        )
    log.error("A2A request failed", exc_info=exc)
    return e.InternalError(
        "internal error; the server log has the details under request id "
        f"{correlation_id.get() or '-'}"
    )


REVOKED = "the credential that opened this stream was revoked"


async def sse(
    request: web.Request,
    stream: TaskStream,
    frame: Callable[[dict[str, Any]], dict[str, Any]],
    on_error: Callable[[e.A2AError], dict[str, Any]],
    history_length: int | None = None,
) -> web.StreamResponse:
    """The snapshot (a `task` StreamResponse), then every event as it happens, until the task
    ends (or the client leaves, the credential is revoked, or the server stops)."""
    principal = current_principal(request)
    assert principal is not None  # resolve() ran first
    try:
        out = await EventStream.open(request, principal, retry_ms=None)
    except TooManyStreams as exc:
        stream.close()
        raise e.QuotaExceededError(str(exc), headers={"Retry-After": "5"}) from None

    async def send(obj: dict[str, Any], event: str | None = None) -> None:
        await out.send(json.dumps(obj, ensure_ascii=False, separators=(",", ":")), event=event)

    try:
        await send(frame({"task": stream.snapshot.to_a2a(history_length=history_length)}))
        try:
            async for ev in out.follow(stream.events()):
                await send(frame(ev))
        except ConnectionError:
            raise
        except Exception as exc:
            await send(on_error(unexpected(exc)), "error")
        if out.revoked:
            await send(on_error(e.UnauthenticatedError(f"{REVOKED} ({out.reason})")), "error")
    except ConnectionError:
        pass
    finally:
        await out.close()
        stream.close()
    return out.response
