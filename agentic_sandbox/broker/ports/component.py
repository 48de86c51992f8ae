"""The ports component: the reverse proxy's and the tunnel's routes over port streams."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.agentlink import AgentRegistry
from agentic_sandbox.broker.ports.service import PortsService
from agentic_sandbox.broker.services import Services


class PortsComponent:
    name = "ports"

    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.service = PortsService(svc, registry)

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.ports import routes

        app[routes.PORTS_KEY] = self.service
        routes.api.install(app)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
