"""`POST /api/v2/admin/instances/{id}/exec` (one JSON answer) and `…/exec/stream` (NDJSON).

Roles and ownership as every other instance change: the operator role, and the instance's
owner or an admin (another owner's instance is a 404; viewers get 403, A2A keys 403).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from aiohttp import web

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.exec.models import ExecOut, ExecRequest
from agentic_sandbox.broker.exec.service import ExecPlan, ExecService
from agentic_sandbox.broker.http.problems import not_ready
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoQuery
from agentic_sandbox.broker.instances import LOADOUTS, instance_to_change
from agentic_sandbox.broker.services import services
from agentic_sandbox.broker.sessions import instance_budgets

api = ApiRoutes()

EXEC_KEY: web.AppKey[ExecService] = web.AppKey("exec_service")
ERRORS = {
    413: "stdin over SANDBOX_EXEC_MAX_STDIN_BYTES",
    422: "bad argv, cwd, user or budget (the field is named)",
    429: "too many execs on the instance (SANDBOX_EXEC_MAX_PER_INSTANCE)",
    501: "the agent does not run exec",
    502: "the agent link was lost while the command ran",
    503: "the instance's agent is not connected",
}


async def _plan(call: Call[ExecRequest, NoQuery]) -> tuple[ExecService, ExecPlan]:
    who = call.require_principal()
    row = await instance_to_change(services(call.request).db, who, call.match["instance_id"])
    catalog = call.app[LOADOUTS].catalog if LOADOUTS in call.app else None
    service = call.app[EXEC_KEY]
    plan = service.plan(
        instance_id=row.id,
        owner=row.owner,
        actor=who.actor,
        body=call.body,
        loadout_budgets=instance_budgets(row.spec, row.loadout, catalog),
    )
    if plan.conn.incarnation != row.incarnation:
        raise not_ready(f"the agent of instance {row.id!r} is not connected")
    return service, plan


@api.post(
    "/api/v2/admin/instances/{instance_id}/exec",
    body=ExecRequest,
    response=ExecOut,
    role=Role.operator,
    summary="Run a command (argv) on the instance and answer its exit, output and usage",
    tag="exec",
    responses=ERRORS,
)
async def run_exec(call: Call[ExecRequest, NoQuery]) -> ExecOut:
    """Runs `argv` through the agent link (no shell unless argv names one), with the budget
    (the request's values within the loadout's defaults and ceilings), and answers once it
    ends: exit code or signal, the budget `reason` that ended it (timeout, memory, pids,
    output-limit), stdout and stderr (each up to its limit, `truncated` past it), duration and
    usage."""
    service, plan = await _plan(call)
    with service.slot(plan.instance_id):
        await service.start(plan)
        return await service.collect(plan)


@api.post(
    "/api/v2/admin/instances/{instance_id}/exec/stream",
    body=ExecRequest,
    role=Role.operator,
    summary="Run a command and stream its output as NDJSON lines as they come",
    tag="exec",
    content_type="application/x-ndjson",
    responses=ERRORS,
)
async def stream_exec(call: Call[ExecRequest, NoQuery]) -> web.StreamResponse:
    """One JSON object per line: `{"type":"started","exec_id","pid","enforcement","budget"}`,
    then `{"type":"stdout"|"stderr","data"}` as output comes (text, or base64 with
    `output_encoding: base64`), then `{"type":"exit", …the JSON answer's fields…}` — or
    `{"type":"error","status","code","detail"}` if it could not finish (link lost, credential
    revoked). Problems before the command starts are ordinary problem+json answers."""
    service, plan = await _plan(call)
    who = call.require_principal()
    with service.slot(plan.instance_id), services(call.request).streams.open(who, "exec") as lease:
        lease.on_revoke(lambda reason: service.stop(plan, f"credential revoked: {reason}"))
        await service.start(plan)
        resp = web.StreamResponse(
            status=200,
            headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"},
        )
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(call.request)
        except (ConnectionError, RuntimeError):
            service.stop(plan, "the caller went away")
            raise
        async with contextlib.aclosing(service.events(plan)) as events:
            async for line in events:
                if lease.revoked.is_set():
                    line = _revoked()
                try:
                    await resp.write(_encode(line))
                except (ConnectionError, RuntimeError):
                    break  # the caller went away: closing the events stops the command
                if line["type"] == "error":
                    break
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp


def _revoked() -> dict[str, Any]:
    return {
        "type": "error",
        "status": 401,
        "code": "credential-revoked",
        "detail": "the credential this stream was opened with was revoked",
    }


def _encode(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"
