"""One undo helper for every multi-step operation (create, clones, capture, pool fill).

Each step that made something registers how to take it back (`Transaction.on_undo`). When any
step fails, the steps taken are undone newest first — shielded from cancellation, each one on
its own (a failing undo step is logged and the next one still runs) — and the *original* error
propagates: an undo step never replaces it. A fleet error gets the stage that failed; with a
description, any other error (but cancellation) becomes a `FleetError` naming the stage::

    async with Transaction(f"create {iid}", stage="placing") as tx:
        port = host.ports.allocate()
        tx.on_undo("port", lambda: host.ports.release(port))
        tx.stage = "disk"
        ...
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from .errors import FleetError

log = logging.getLogger(__name__)

UndoStep = Callable[[], Awaitable[Any] | Any]


class Transaction:
    def __init__(
        self,
        what: str | None = None,
        *,
        stage: str = "",
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.what = what  # None: errors propagate as they are (no stage, no wrapping)
        self.stage = stage
        self._on_failure = on_failure  # runs first when a step fails (e.g. mark "deleting")
        self._steps: list[tuple[str, UndoStep]] = []

    def on_undo(self, what: str, step: UndoStep) -> None:
        """If a later step fails, run ``step`` (a function, or one returning an awaitable)."""
        self._steps.append((what, step))

    async def rollback(self) -> None:
        steps, self._steps = self._steps, []
        for what, step in reversed(steps):
            try:
                result = step()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("clean-up step %r failed", what)

    async def __aenter__(self) -> Transaction:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if ev is None:
            self._steps.clear()  # committed: nothing to take back
            return False
        if self._on_failure is not None:
            self._on_failure()
        await asyncio.shield(self.rollback())
        if self.what is None or isinstance(ev, asyncio.CancelledError):
            return False
        if isinstance(ev, FleetError):
            ev.stage = ev.stage or self.stage
            return False
        raise FleetError(f"{self.what} failed at {self.stage}: {ev}", stage=self.stage) from ev
