"""The provisioning pipeline's `Enroller`, implemented over the agent link."""

from __future__ import annotations

import asyncio
import datetime as dt

from sqlalchemy import delete

from agentic_sandbox.broker.agentlink import AgentLinkComponent
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import AGENT_LINK_ADDRESS
from agentic_sandbox.provision import EnrollmentGrant

DEFAULT_SERVER_NAME = "agentic-sandbox-server"


class LinkEnroller:
    """Grants one-time enrollment tokens and waits for the instance's agent to connect."""

    def __init__(self, link: AgentLinkComponent, settings: Settings) -> None:
        self._link = link
        self._settings = settings
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        link.registry.listeners.append(self._on_agent)

    @property
    def agent_port(self) -> int:
        return self._settings.grpc_address[1]

    @property
    def enroll_port(self) -> int:
        return self._settings.grpc_enroll_address[1]

    def _on_agent(self, conn: object, state: str) -> None:
        instance_id = getattr(conn, "instance_id", None)
        if state != "connected" or instance_id is None:
            return
        for fut in self._waiters.pop(instance_id, []):
            if not fut.done():
                fut.set_result(None)

    async def grant(self, instance_id: str) -> EnrollmentGrant:
        ttl = dt.timedelta(seconds=self._settings.enrollment_token_ttl_seconds)
        issued = await self._link.enrollment.create_token(instance_id, ttl)
        return EnrollmentGrant(
            token=issued.token,
            ca_pem=self._link.ca.certificate_pem.decode(),
            server_address=f"{AGENT_LINK_ADDRESS}:{self.agent_port}",
            server_name=DEFAULT_SERVER_NAME,
            agent_port=self.agent_port,
            enroll_address=f"{AGENT_LINK_ADDRESS}:{self.enroll_port}",
        )

    async def wait_ready(self, instance_id: str) -> None:
        if self._link.registry.ready(instance_id):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(instance_id, []).append(fut)
        try:
            await fut
        finally:
            waiting = self._waiters.get(instance_id)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[instance_id]

    async def forget(self, instance_id: str) -> None:
        """Revoke the instance's certificates and delete its unused enrollment tokens."""
        await self._link.enrollment.revoke_instance(instance_id)
        async with self._link.svc.db.session() as s:
            await s.execute(
                delete(m.EnrollmentToken).where(
                    m.EnrollmentToken.instance_id == instance_id,
                    m.EnrollmentToken.used_at.is_(None),
                )
            )
