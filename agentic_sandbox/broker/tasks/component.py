"""The task layer as a server component: the service's lifecycle, the v1 and missions routes."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.sessions import SessionService
from agentic_sandbox.broker.tasks import missions, v1_routes
from agentic_sandbox.broker.tasks.keys import TASKS
from agentic_sandbox.broker.tasks.live import LiveTasks
from agentic_sandbox.broker.tasks.machine import TaskMachine
from agentic_sandbox.broker.tasks.push import PushNotifier
from agentic_sandbox.broker.tasks.service import TaskService
from agentic_sandbox.broker.tasks.store import TaskStore


class TasksComponent:
    name = "tasks"

    def __init__(self, svc: Services, sessions: SessionService) -> None:
        """`sessions` is the session layer's contract (the hub, or a fake in tests)."""
        self.svc = svc
        store = TaskStore(svc.db)
        machine = TaskMachine(
            store=store,
            live=LiveTasks(),
            audit=svc.audit,
            events=svc.events,
            metrics=svc.metrics,
            settings=svc.settings,
        )
        push = PushNotifier(
            store=store,
            vault=svc.vault,
            events=svc.events,
            audit=svc.audit,
            metrics=svc.metrics,
            settings=svc.settings,
        )
        self.service = TaskService(
            db=svc.db,
            machine=machine,
            events=svc.events,
            push=push,
            sessions=lambda: sessions,
            settings=svc.settings,
        )
        svc.incarnations.on_end("tasks", self.service.end_incarnation)
        svc.metrics.provide(
            "sandbox_tasks_active",
            "Unfinished tasks by state",
            ("state",),
            self.service.active_counts,
        )

    def install(self, app: web.Application) -> None:
        app[TASKS] = self.service
        v1_routes.api.install(app)
        missions.api.install(app)
        app.on_response_prepare.append(v1_routes.on_prepare)

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop()
