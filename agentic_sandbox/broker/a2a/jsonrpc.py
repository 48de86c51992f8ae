"""The JSON-RPC 2.0 binding: `POST /agents/{instance_id}` (and with a trailing slash).

Methods are the A2A 1.0 operation names. Errors are JSON-RPC error objects (HTTP 200) whose
`data` holds a google.rpc.ErrorInfo; a missing or refused credential is HTTP 401/403.
Streaming methods answer with Server-Sent Events, each `data:` a JSON-RPC response whose
`result` is a StreamResponse.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from agentic_sandbox.broker.a2a import errors as e
from agentic_sandbox.broker.a2a import models as w
from agentic_sandbox.broker.a2a.binding import (
    HANDLER,
    parse_params,
    read_json,
    resolve,
    sse,
    unexpected,
)
from agentic_sandbox.broker.a2a.handler import A2ACall, A2AHandler

Method = Callable[[A2AHandler, A2ACall, Any], Awaitable[Any]]

UNARY: dict[str, tuple[type[BaseModel], Method]] = {
    "SendMessage": (w.SendMessageRequest, lambda h, c, r: h.send_message(c, r)),
    "GetTask": (w.GetTaskRequest, lambda h, c, r: h.get_task(c, r)),
    "ListTasks": (w.ListTasksRequest, lambda h, c, r: h.list_tasks(c, r)),
    "CancelTask": (w.CancelTaskRequest, lambda h, c, r: h.cancel_task(c, r)),
    "CreateTaskPushNotificationConfig": (
        w.TaskPushNotificationConfig,
        lambda h, c, r: h.create_push_config(c, r),
    ),
    "GetTaskPushNotificationConfig": (
        w.GetTaskPushNotificationConfigRequest,
        lambda h, c, r: h.get_push_config(c, r),
    ),
    "ListTaskPushNotificationConfigs": (
        w.ListTaskPushNotificationConfigsRequest,
        lambda h, c, r: h.list_push_configs(c, r),
    ),
    "DeleteTaskPushNotificationConfig": (
        w.DeleteTaskPushNotificationConfigRequest,
        lambda h, c, r: h.delete_push_config(c, r),
    ),
    "GetExtendedAgentCard": (
        w.GetExtendedAgentCardRequest,
        lambda h, c, r: h.extended_card(c),
    ),
}
STREAMING: dict[str, tuple[type[BaseModel], Method]] = {
    "SendStreamingMessage": (
        w.SendMessageRequest,
        lambda h, c, r: h.send_streaming_message(c, r),
    ),
    "SubscribeToTask": (w.SubscribeToTaskRequest, lambda h, c, r: h.subscribe(c, r)),
}
# Names used by drafts of the 1.0 specification.
ALIASES = {
    "SetTaskPushNotificationConfig": "CreateTaskPushNotificationConfig",
    "ListTaskPushNotificationConfig": "ListTaskPushNotificationConfigs",
}


def _reply(request_id: e.RequestId, result: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def _error(request_id: e.RequestId, err: e.A2AError) -> web.Response:
    status = err.http if isinstance(err, e.TRANSPORT_LEVEL) else 200
    return web.Response(
        status=status,
        body=json.dumps(err.jsonrpc(request_id), separators=(",", ":")).encode(),
        content_type="application/json",
        headers=err.headers,
    )


async def endpoint(request: web.Request) -> web.StreamResponse:
    request_id: e.RequestId = None
    try:
        body = await read_json(request)
        if isinstance(body, list):
            raise e.InvalidRequestError("batch requests are not supported")
        if not isinstance(body, dict):
            raise e.InvalidRequestError("the body must be a JSON-RPC 2.0 request object")
        rid = body.get("id")
        if rid is None or (isinstance(rid, str | int) and not isinstance(rid, bool)):
            request_id = rid
        else:
            raise e.InvalidRequestError("id must be a string, a number or null")
        if body.get("jsonrpc") != "2.0":
            raise e.InvalidRequestError('jsonrpc must be exactly "2.0"')
        method = body.get("method")
        if not isinstance(method, str) or not method:
            raise e.InvalidRequestError("method is required")
        call = await resolve(request)  # credentials, A2A-Version, the agent
        method = ALIASES.get(method, method)
        entry = UNARY.get(method) or STREAMING.get(method)
        if entry is None:
            raise e.MethodNotFoundError(
                f"no method {method[:100]!r}", metadata={"method": method[:100]}
            )
        params = body.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise e.InvalidParamsError(
                "params must be an object",
                fields=[{"field": "params", "description": "must be an object"}],
            )
        model, fn = entry
        req = parse_params(model, params)
        handler = request.app[HANDLER]
        if method in STREAMING:
            stream = await fn(handler, call, req)
            return await sse(
                request,
                stream,
                frame=lambda ev: _reply(request_id, ev),
                on_error=lambda err: err.jsonrpc(request_id),
            )
        result = await fn(handler, call, req)
        return web.Response(
            body=json.dumps(
                _reply(request_id, result), ensure_ascii=False, separators=(",", ":")
            ).encode(),
            content_type="application/json",
        )
    except e.A2AError as err:
        return _error(request_id, err)
    except Exception as exc:
        return _error(request_id, unexpected(exc))
