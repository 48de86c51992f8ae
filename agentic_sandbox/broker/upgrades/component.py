"""The upgrades component: the bundle store, the rollouts and their routes."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.agentlink import AgentRegistry
from agentic_sandbox.broker.operations import OperationRunner
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.upgrades.bundles import BundleStore
from agentic_sandbox.broker.upgrades.rollout import Rollouts


class UpgradesComponent:
    name = "upgrades"

    def __init__(self, svc: Services, registry: AgentRegistry, ops: OperationRunner) -> None:
        self.bundles = BundleStore(svc)
        self.rollouts = Rollouts(svc, registry, ops)

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.upgrades import routes

        app[routes.BUNDLES_KEY] = self.bundles
        app[routes.ROLLOUTS_KEY] = self.rollouts
        routes.api.install(app)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
