"""The A2A surface as a server component: every instance is an A2A 1.0 agent under
`/agents/{instance_id}` (card, JWKS, JSON-RPC and HTTP+JSON bindings)."""

from __future__ import annotations

from aiohttp import web

from agentic_sandbox.broker.a2a import discovery, jsonrpc, rest
from agentic_sandbox.broker.a2a.binding import HANDLER
from agentic_sandbox.broker.a2a.card import CardCache
from agentic_sandbox.broker.a2a.handler import A2AHandler
from agentic_sandbox.broker.a2a.signing import InstanceKeys
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.tasks import TaskService

PREFIX = "/agents/{instance_id}"


class A2AComponent:
    name = "a2a"

    def __init__(self, svc: Services, tasks: TaskService) -> None:
        self.keys = InstanceKeys(svc.db, svc.vault)
        svc.incarnations.on_end("agent-card keys", self.keys.end_incarnation)
        self.handler = A2AHandler(tasks, CardCache(self.keys), svc.settings)

    def install(self, app: web.Application) -> None:
        app[HANDLER] = self.handler
        r = app.router
        r.add_get(PREFIX + "/.well-known/agent-card.json", discovery.agent_card, name="a2a.card")
        r.add_get(PREFIX + "/.well-known/jwks.json", discovery.jwks, name="a2a.jwks")
        r.add_post(PREFIX, jsonrpc.endpoint, name="a2a.jsonrpc")
        r.add_post(PREFIX + "/", jsonrpc.endpoint, name="a2a.jsonrpc.slash")
        rest.install(r, PREFIX)
        r.add_route("*", PREFIX + "/{tail:.*}", rest.not_a_method, name="a2a.unknown")

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
