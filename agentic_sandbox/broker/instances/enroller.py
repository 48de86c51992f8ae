"""The provisioning pipeline's `Enroller`, implemented over the agent link."""

from __future__ import annotations

import asyncio
import datetime as dt

from agentic_sandbox.broker.agentlink import AgentConnection, AgentLinkComponent
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.fleet import AGENT_LINK_ADDRESS
from agentic_sandbox.provision import EnrollmentGrant

DEFAULT_SERVER_NAME = "agentic-sandbox-server"


class LinkEnroller:
    """Grants one-time enrollment tokens and waits for the incarnation's agent to connect.

    Readiness counts only a link whose certificate names the incarnation being provisioned: a
    live link of an earlier instance with the same id (never closed, or a hostile process that
    kept its certificate) does not make a new provision succeed."""

    def __init__(self, link: AgentLinkComponent, settings: Settings) -> None:
        self._link = link
        self._settings = settings
        self._waiters: dict[tuple[str, str], list[asyncio.Future[None]]] = {}
        link.registry.listeners.append(self._on_agent)

    @property
    def agent_port(self) -> int:
        """The guest link gateway's port: every guest forward targets it."""
        return self._link.ports.get("guest") or self._settings.guest_link_address[1]

    def _on_agent(self, conn: AgentConnection, state: str) -> None:
        if state != "connected":
            return
        for fut in self._waiters.pop((conn.instance_id, conn.incarnation), []):
            if not fut.done():
                fut.set_result(None)

    @property
    def ca_pem(self) -> str:
        """The agent link's CA certificate (public)."""
        return self._link.ca.certificate_pem.decode()

    async def grant(self, instance_id: str, incarnation: str) -> EnrollmentGrant:
        ttl = dt.timedelta(seconds=self._settings.enrollment_token_ttl_seconds)
        issued = await self._link.enrollment.create_token(instance_id, ttl, incarnation)
        return EnrollmentGrant(
            token=issued.token,
            ca_pem=self.ca_pem,
            gateway_address=f"{AGENT_LINK_ADDRESS}:{self.agent_port}",
            server_name=DEFAULT_SERVER_NAME,
            agent_port=self.agent_port,
        )

    async def wait_ready(self, instance_id: str, incarnation: str) -> None:
        if self._link.registry.ready(instance_id, incarnation):
            return
        key = (instance_id, incarnation)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        try:
            await fut
        finally:
            waiting = self._waiters.get(key)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[key]

    async def forget(self, instance_id: str, incarnation: str) -> None:
        """Cut off the incarnation's agent: close its link if one is up, revoke its
        certificates and delete its unused enrollment tokens (after a failed provision)."""
        self._link.registry.end_incarnation(instance_id, incarnation, "the provision failed")
        await self._link.enrollment.end_incarnation(instance_id, incarnation)
