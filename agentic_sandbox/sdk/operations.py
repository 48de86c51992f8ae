"""Long-running operations (provisioning, clones, image builds, warm pools): get, list,
cancel, and wait with a progress callback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agentic_sandbox.sdk.errors import OperationFailed
from agentic_sandbox.sdk.models import Operation
from agentic_sandbox.sdk.transport import Transport

Progress = Callable[[Operation], None]

ADMIN = "/api/v2/admin"


class Resource:
    def __init__(self, transport: Transport) -> None:
        self._t = transport


def operation_id(op: Operation | str) -> str:
    return op if isinstance(op, str) else op.id


class AsyncOperations(Resource):
    async def get(self, operation: Operation | str) -> Operation:
        return await self._t.model(
            Operation, "GET", f"{ADMIN}/operations/{operation_id(operation)}"
        )

    async def list(
        self, *, subject_id: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[Operation]:
        """Newest first."""
        params = {"subject_id": subject_id, "state": state, "limit": limit}
        return await self._t.items(Operation, f"{ADMIN}/operations", params)

    async def cancel(self, operation: Operation | str) -> Operation:
        """Ask a running operation to stop (its half-made work is cleaned up)."""
        return await self._t.model(
            Operation, "POST", f"{ADMIN}/operations/{operation_id(operation)}/cancel"
        )

    async def wait(
        self,
        operation: Operation | str,
        *,
        timeout: float | None = None,
        progress: Progress | None = None,
        check: bool = True,
    ) -> Operation:
        """Poll until the operation ends; `progress(op)` on every change of stage or progress.
        A failed or canceled one raises `OperationFailed` (its stage and cause) unless
        `check=False`; `TimeoutError` after `timeout` seconds."""
        op = operation if isinstance(operation, Operation) else await self.get(operation)
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: tuple[str, str | None, float] | None = None
        delay = 0.1
        while True:
            now = (op.state, op.stage, op.progress)
            if progress is not None and now != seen:
                progress(op)
            seen = now
            if op.done:
                break
            if deadline is not None and time.monotonic() + delay > deadline:
                raise TimeoutError(
                    f"{op.kind} {op.subject_id} still {op.state} at {op.stage} after {timeout}s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)
            op = await self.get(op.id)
        if check and op.state != "succeeded":
            raise OperationFailed(op)
        return op
