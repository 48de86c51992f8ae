"""The exec component: its routes and the service that runs commands over agent links."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.agentlink import AgentRegistry
from agentic_sandbox.broker.exec.service import ExecService
from agentic_sandbox.broker.services import Services


class ExecComponent:
    name = "exec"

    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.service = ExecService(svc, registry)

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.exec import routes

        app[routes.EXEC_KEY] = self.service
        routes.api.install(app)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
