"""The sessions component: the hub, the admin session routes and the attach WebSocket."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.sessions.hub import HUB_KEY, SessionHub


class SessionsComponent:
    name = "sessions"

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.hub = SessionHub(svc)
        svc.incarnations.on_end("sessions", self.hub.end_incarnation)

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.sessions import attach, routes

        app[HUB_KEY] = self.hub
        routes.api.install(app)
        attach.api.install(app)

    async def start(self) -> None:
        await self.hub.start()

    async def stop(self) -> None:
        await self.hub.stop()
