"""The fleet's errors as problem+json: one mapping for every admin route over the fleet.

Routes declared with `FleetRoutes` need not catch anything: the services' errors
(`instances/errors.py`) and the fleet's (`FleetError`) are turned into problems here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.http.problems import (
    ProblemError,
    conflict,
    not_found,
    not_ready,
    too_many,
)
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, Handler
from agentic_sandbox.broker.instances.access import InstanceView, instance_view
from agentic_sandbox.broker.instances.errors import (
    ConflictError,
    FleetUnavailable,
    ForbiddenError,
    InstanceError,
    InvalidInput,
    NotFoundError,
    QuotaExceeded,
)
from agentic_sandbox.broker.store import Database
from agentic_sandbox.fleet import (
    Conflict,
    FleetError,
    HostUnavailable,
    InvalidRequest,
    NoCapacity,
    NotFound,
)


def fleet_problem(exc: FleetError) -> ProblemError:
    if isinstance(exc, NotFound):
        return ProblemError(404, str(exc))
    if isinstance(exc, Conflict):
        return conflict(str(exc))
    if isinstance(exc, InvalidRequest):
        return ProblemError(422, str(exc))
    if isinstance(exc, NoCapacity):
        return ProblemError(409, str(exc), code="no-capacity")
    if isinstance(exc, HostUnavailable):
        return not_ready(str(exc))
    return ProblemError(502, f"libvirt failed: {exc}", code="libvirt-error")


def instance_problem(exc: InstanceError) -> ProblemError:
    if isinstance(exc, NotFoundError):
        return not_found(exc.kind, exc.ident)
    if isinstance(exc, ForbiddenError):
        return ProblemError(403, exc.message)
    if isinstance(exc, ConflictError):
        return conflict(exc.message, code=exc.code, extra=dict(exc.extra))
    if isinstance(exc, InvalidInput):
        field = f"body.{exc.field}"
        return ProblemError(
            422,
            f"{field}: {exc.detail}",
            code=exc.code,
            errors=[{"field": field, "message": exc.summary or exc.detail, "type": "value"}],
            extra=dict(exc.extra),
        )
    if isinstance(exc, QuotaExceeded):
        return too_many(exc.message, retry_after=exc.retry_after)
    if isinstance(exc, FleetUnavailable):
        return not_ready(exc.message, retry_after=exc.retry_after)
    raise TypeError(f"no problem for {type(exc).__name__}")  # a new error kind needs a mapping


async def instance_to_change(db: Database, who: Principal, instance_id: str) -> InstanceView:
    """The instance if the caller may change it, for routes outside the fleet's own (exec,
    files, ports, egress): a read-only view, its errors as problems."""
    try:
        return await instance_view(db, who, instance_id, change=True)
    except InstanceError as exc:
        raise instance_problem(exc) from None


async def instance_to_see(db: Database, who: Principal, instance_id: str) -> InstanceView:
    """The instance if the caller may see it (files, egress): a read-only view, its errors as
    problems."""
    try:
        return await instance_view(db, who, instance_id, change=False)
    except InstanceError as exc:
        raise instance_problem(exc) from None


def _mapped(fn: Handler) -> Handler:
    @functools.wraps(fn)
    async def handler(call: Call[BaseModel, BaseModel]) -> BaseModel | web.StreamResponse | None:
        try:
            return await fn(call)
        except InstanceError as exc:
            raise instance_problem(exc) from None
        except FleetError as exc:
            raise fleet_problem(exc) from None

    return handler


class FleetRoutes(ApiRoutes):
    """`ApiRoutes` whose handlers' fleet and service errors become problems."""

    def route(self, method: str, path: str, **kw: Any) -> Callable[[Handler], Handler]:
        register = super().route(method, path, **kw)

        def declare(fn: Handler) -> Handler:
            register(_mapped(fn))
            return fn

        return declare
