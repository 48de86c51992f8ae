"""The fleet's long-running operations (provisions, image builds, pool preparations) as their
owners see them: listed, looked at, canceled (a canceled provision leaves nothing)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.errors import NotFoundError
from agentic_sandbox.broker.operations import OperationRunner
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m


@dataclass(frozen=True)
class OperationFilter:
    subject_id: str | None = None
    state: str | None = None
    limit: int = 100


class Operations:
    def __init__(self, svc: Services, runner: OperationRunner) -> None:
        self._svc = svc
        self._runner = runner

    async def list_operations(self, who: Principal, where: OperationFilter) -> list[m.Operation]:
        """The caller's operations (everyone's for admins), newest first."""
        stmt = select(m.Operation).order_by(m.Operation.created_at.desc())
        if not who.is_admin:
            stmt = stmt.where(m.Operation.owner == who.subject)
        if where.subject_id:
            stmt = stmt.where(m.Operation.subject_id == where.subject_id)
        if where.state:
            stmt = stmt.where(m.Operation.state == where.state)
        async with self._svc.db.session() as s:
            return list((await s.scalars(stmt.limit(where.limit))).all())

    async def get(self, who: Principal, op_id: str) -> m.Operation:
        op = await self._runner.get(op_id)
        if op is None or not who.can_see(op.owner):
            raise NotFoundError("operation", op_id)
        return op

    async def cancel(self, who: Principal, op_id: str) -> m.Operation:
        """Cancel a running operation and wait for it to end; the operation as it ended."""
        op = await self.get(who, op_id)
        await self._runner.cancel(op.id)
        fresh = await self._runner.get(op.id)
        assert fresh is not None
        return fresh
