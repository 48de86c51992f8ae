"""The files component: its routes and the service that moves files over agent links."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.agentlink import AgentRegistry
from agentic_sandbox.broker.files.service import FilesService
from agentic_sandbox.broker.files.tasks import TaskFilesAdapter
from agentic_sandbox.broker.services import Services


class FilesComponent:
    name = "files"

    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.service = FilesService(svc, registry)
        # A2A file parts: the task layer's files path (wired in broker/components.py)
        self.task_files = TaskFilesAdapter(self.service)

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.files import routes

        app[routes.FILES_KEY] = self.service
        routes.api.install(app)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
