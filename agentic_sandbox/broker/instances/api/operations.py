"""Admin routes for long-running operations: provisions, image builds, pool preparations."""

from __future__ import annotations

from pydantic import Field

from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.http.routing import Call, NoBody, NoQuery
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.instances.api.models import OperationOut
from agentic_sandbox.broker.instances.api.problems import FleetRoutes
from agentic_sandbox.broker.instances.keys import OPERATIONS
from agentic_sandbox.broker.instances.operations import OperationFilter

api = FleetRoutes()


class OperationQuery(Input):
    subject_id: str | None = Field(default=None, max_length=128)
    state: str | None = Field(default=None, max_length=16)
    limit: int = Field(default=100, ge=1, le=1000)


class OperationList(Output):
    items: list[OperationOut]


@api.get(
    "/api/v2/admin/operations",
    query=OperationQuery,
    response=OperationList,
    role=Role.viewer,
    summary="Long-running operations (provisioning, image builds), newest first",
    tag="operations",
)
async def list_operations(call: Call[NoBody, OperationQuery]) -> OperationList:
    q = call.query
    where = OperationFilter(subject_id=q.subject_id, state=q.state, limit=q.limit)
    rows = await call.app[OPERATIONS].list_operations(call.require_principal(), where)
    return OperationList(items=[OperationOut.model_validate(r) for r in rows])


@api.get(
    "/api/v2/admin/operations/{operation_id}",
    response=OperationOut,
    role=Role.viewer,
    summary="One operation with its stages and progress",
    tag="operations",
)
async def get_operation(call: Call[NoBody, NoQuery]) -> OperationOut:
    op = await call.app[OPERATIONS].get(call.require_principal(), call.match["operation_id"])
    return OperationOut.model_validate(op)


@api.post(
    "/api/v2/admin/operations/{operation_id}/cancel",
    response=OperationOut,
    role=Role.operator,
    summary="Cancel a running operation (its half-made work is cleaned up)",
    tag="operations",
)
async def cancel_operation(call: Call[NoBody, NoQuery]) -> OperationOut:
    op = await call.app[OPERATIONS].cancel(call.require_principal(), call.match["operation_id"])
    return OperationOut.model_validate(op)
