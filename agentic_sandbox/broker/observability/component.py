"""Scrape-time gauges computed from the store (instances by state/host, tasks by state).

Collectors run synchronously inside a scrape, so they cannot query the database; a small
background task refreshes the counts every few seconds and the collectors read the snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from sqlalchemy import func, select

from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

REFRESH_SECONDS = 5.0


class StoreGauges:
    name = "store-gauges"

    def __init__(self, svc: Services, interval: float = REFRESH_SECONDS) -> None:
        self._svc = svc
        self._interval = interval
        self._instances: dict[tuple[str, ...], float] = {}
        self._tasks: dict[tuple[str, ...], float] = {}
        self._task: asyncio.Task[None] | None = None
        svc.metrics.provide(
            "sandbox_instances",
            "Instances by state and host",
            ("state", "host"),
            lambda: self._instances,
        )
        svc.metrics.provide("sandbox_tasks", "Tasks by A2A state", ("state",), lambda: self._tasks)

    def install(self, app: web.Application) -> None:
        return None

    async def refresh(self) -> None:
        async with self._svc.db.session() as s:
            rows = (
                await s.execute(
                    select(m.Instance.state, m.Instance.host, func.count())
                    .where(m.Instance.deleted_at.is_(None))
                    .group_by(m.Instance.state, m.Instance.host)
                )
            ).all()
            self._instances = {(state, host or ""): float(n) for state, host, n in rows}
            trows = (
                await s.execute(select(m.Task.state, func.count()).group_by(m.Task.state))
            ).all()
            self._tasks = {(state,): float(n) for state, n in trows}

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("refreshing store gauges failed")
            await asyncio.sleep(self._interval)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="store-gauges")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
