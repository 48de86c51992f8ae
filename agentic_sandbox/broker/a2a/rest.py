"""The HTTP+JSON binding under `/agents/{instance_id}`, with the paths of the A2A 1.0 proto's
HTTP annotations:

    POST   /message:send                           SendMessage
    POST   /message:stream                         SendStreamingMessage (SSE)
    GET    /tasks/{id}                             GetTask (?historyLength=)
    GET    /tasks                                  ListTasks (query parameters)
    POST   /tasks/{id}:cancel                      CancelTask
    GET    /tasks/{id}:subscribe (POST accepted)   SubscribeToTask (SSE)
    POST   /tasks/{id}/pushNotificationConfigs     CreateTaskPushNotificationConfig
    GET    /tasks/{id}/pushNotificationConfigs     ListTaskPushNotificationConfigs
    GET    /tasks/{id}/pushNotificationConfigs/{c} GetTaskPushNotificationConfig
    DELETE /tasks/{id}/pushNotificationConfigs/{c} DeleteTaskPushNotificationConfig
    GET    /extendedAgentCard                      GetExtendedAgentCard

Errors are google.rpc.Status objects (`{"error": {code, status, message, details}}`) with the
HTTP status of the A2A error mapping; SSE streams carry one StreamResponse per `data:` line.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from agentic_sandbox.broker.a2a import errors as e
from agentic_sandbox.broker.a2a import models as w
from agentic_sandbox.broker.a2a.binding import (
    HANDLER,
    json_response,
    parse_params,
    read_json,
    resolve,
    sse,
    unexpected,
)
from agentic_sandbox.broker.a2a.handler import A2ACall, A2AHandler

M = TypeVar("M", bound=BaseModel)
TASK = "{task_id:[^/:]+}"

View = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(err: e.A2AError) -> web.Response:
    return web.Response(
        status=err.http,
        body=json.dumps(err.rest(), separators=(",", ":")).encode(),
        content_type="application/json",
        headers=err.headers,
    )


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise e.InvalidRequestError("the body must be a JSON object")
    return body


def _query(request: web.Request) -> dict[str, Any]:
    return {k: request.query.get(k) for k in request.query}


def view(
    fn: Callable[[web.Request, A2AHandler, A2ACall], Awaitable[web.StreamResponse]],
) -> View:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            call = await resolve(request)
            return await fn(request, request.app[HANDLER], call)
        except e.A2AError as err:
            return _error(err)
        except Exception as exc:
            return _error(unexpected(exc))

    handle.__name__ = fn.__name__
    return handle


@view
async def send_message(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    req = parse_params(w.SendMessageRequest, await _body(request))
    return json_response(request, await h.send_message(call, req))


@view
async def send_streaming_message(
    request: web.Request, h: A2AHandler, call: A2ACall
) -> web.StreamResponse:
    req = parse_params(w.SendMessageRequest, await _body(request))
    stream = await h.send_streaming_message(call, req)
    return await sse(request, stream, frame=lambda ev: ev, on_error=lambda err: err.rest())


@view
async def get_task(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    req = parse_params(w.GetTaskRequest, {**_query(request), "id": request.match_info["task_id"]})
    return json_response(request, await h.get_task(call, req))


@view
async def list_tasks(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    req = parse_params(w.ListTasksRequest, _query(request))
    return json_response(request, await h.list_tasks(call, req))


@view
async def cancel_task(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    body = await _body(request) if request.can_read_body else {}
    req = parse_params(w.CancelTaskRequest, {**body, "id": request.match_info["task_id"]})
    return json_response(request, await h.cancel_task(call, req))


@view
async def subscribe(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    req = parse_params(w.SubscribeToTaskRequest, {"id": request.match_info["task_id"]})
    stream = await h.subscribe(call, req)
    return await sse(request, stream, frame=lambda ev: ev, on_error=lambda err: err.rest())


@view
async def create_push_config(
    request: web.Request, h: A2AHandler, call: A2ACall
) -> web.StreamResponse:
    task_id = request.match_info["task_id"]
    req = parse_params(w.TaskPushNotificationConfig, {**await _body(request), "taskId": task_id})
    return json_response(request, await h.create_push_config(call, req, task_id))


@view
async def list_push_configs(
    request: web.Request, h: A2AHandler, call: A2ACall
) -> web.StreamResponse:
    values = {**_query(request), "taskId": request.match_info["task_id"]}
    req = parse_params(w.ListTaskPushNotificationConfigsRequest, values)
    return json_response(request, await h.list_push_configs(call, req))


@view
async def get_push_config(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    values = {"taskId": request.match_info["task_id"], "id": request.match_info["config_id"]}
    req = parse_params(w.GetTaskPushNotificationConfigRequest, values)
    return json_response(request, await h.get_push_config(call, req))


@view
async def delete_push_config(
    request: web.Request, h: A2AHandler, call: A2ACall
) -> web.StreamResponse:
    values = {"taskId": request.match_info["task_id"], "id": request.match_info["config_id"]}
    req = parse_params(w.DeleteTaskPushNotificationConfigRequest, values)
    await h.delete_push_config(call, req)
    return json_response(request, {})


@view
async def extended_card(request: web.Request, h: A2AHandler, call: A2ACall) -> web.StreamResponse:
    return json_response(request, await h.extended_card(call))


async def not_a_method(request: web.Request) -> web.StreamResponse:
    return _error(
        e.MethodNotFoundError(
            f"no A2A operation at {request.method} {request.path}",
            metadata={"method": request.method, "path": request.path[:200]},
        )
    )


def install(router: web.UrlDispatcher, prefix: str) -> None:
    """Add the routes under `prefix` (`/agents/{instance_id}`)."""
    tasks = f"{prefix}/tasks"
    router.add_post(f"{prefix}/message:send", send_message, name="a2a.rest.send")
    router.add_post(f"{prefix}/message:stream", send_streaming_message, name="a2a.rest.stream")
    router.add_get(tasks, list_tasks, name="a2a.rest.list")
    router.add_get(f"{tasks}/{TASK}", get_task, name="a2a.rest.get")
    router.add_post(f"{tasks}/{TASK}:cancel", cancel_task, name="a2a.rest.cancel")
    router.add_get(f"{tasks}/{TASK}:subscribe", subscribe, name="a2a.rest.subscribe")
    router.add_post(f"{tasks}/{TASK}:subscribe", subscribe, name="a2a.rest.subscribe.post")
    configs = f"{tasks}/{TASK}/pushNotificationConfigs"
    router.add_post(configs, create_push_config, name="a2a.rest.push.create")
    router.add_get(configs, list_push_configs, name="a2a.rest.push.list")
    router.add_get(configs + "/{config_id}", get_push_config, name="a2a.rest.push.get")
    router.add_delete(configs + "/{config_id}", delete_push_config, name="a2a.rest.push.delete")
    router.add_get(f"{prefix}/extendedAgentCard", extended_card, name="a2a.rest.card")
