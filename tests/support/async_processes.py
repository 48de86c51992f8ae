"""A real `sandbox-server` process and real host-side `agent-client` processes, for async tests.

This is a thin asyncio face over the shared test support (`tests/support`: `ServerProcess`,
`AgentProcess`): the server runs as a subprocess on free loopback ports with its own data
directory (SQLite); an agent is a host instance that enrolls with a one-time token over TLS and
holds its mutual-TLS gRPC link — the same path a guest takes. Blocking process control runs in
a worker thread so the test's event loop (SSE readers, push receivers) keeps running.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.agents import AgentProcess, enrollment_token, register_host_instance
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.server import ServerProcess, free_port

__all__ = ["AgentProc", "ServerProc", "free_port"]


@dataclass
class ServerProc:
    tmp: Path
    env: dict[str, str] = field(default_factory=dict)
    test_settings: bool = True  # the shared fast test settings (benchmarks use the defaults)

    def __post_init__(self) -> None:
        base = TEST_SERVER_ENV if self.test_settings else {}
        self.proc = ServerProcess(self.tmp / "server-data", env={**base, **self.env})

    @property
    def data_dir(self) -> Path:
        return self.proc.data_dir

    @property
    def base(self) -> str:
        return self.proc.url

    @property
    def admin(self) -> str:
        return self.proc.admin_token

    def agent_url(self, instance_id: str) -> str:
        return f"{self.base}/agents/{instance_id}"

    async def start(self) -> None:
        await asyncio.to_thread(self.proc.start)

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if sig == signal.SIGKILL:
            await asyncio.to_thread(self.proc.kill9)
        else:
            await asyncio.to_thread(self.proc.stop)

    def log_tail(self) -> str:
        return self.proc.log_tail()

    async def call(
        self, method: str, path: str, token: str | None = None, **kw: Any
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.admin}", **kw.pop("headers", {})}
        async with httpx.AsyncClient(timeout=30) as http:
            return await http.request(method, self.base + path, headers=headers, **kw)

    async def token(self, subject: str, role: str = "operator") -> str:
        r = await self.call("POST", "/api/v2/admin/tokens", json={"subject": subject, "role": role})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    async def api_key(self, instance_id: str, scopes: list[str], token: str | None = None) -> str:
        r = await self.call(
            "POST",
            "/api/v2/admin/api-keys",
            token,
            json={"instance_id": instance_id, "scopes": scopes},
        )
        assert r.status_code == 201, r.text
        return str(r.json()["key"])


@dataclass
class AgentProc:
    server: ServerProc
    instance_id: str
    tmp: Path
    proc: AgentProcess | None = None

    async def enroll_and_start(self, owner_token: str | None = None, **profile: Any) -> None:
        """Register the host instance (owned by `owner_token`'s subject, declaring `profile`:
        skills, task runner, budgets), enroll, connect."""
        srv = self.server.proc

        def start() -> AgentProcess:
            register_host_instance(srv, self.instance_id, token=owner_token, **profile)
            grant = enrollment_token(srv, self.instance_id, token=owner_token)
            agent = AgentProcess(
                srv,
                self.instance_id,
                self.tmp / f"agent-{self.instance_id}",
                enrollment_token=grant,
                max_backoff=0.5,
            )
            agent.start()
            agent.wait_connected()
            return agent

        self.proc = await asyncio.to_thread(start)

    async def wait_connected(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        await asyncio.to_thread(self.proc.wait_connected, timeout)

    def log_tail(self) -> str:
        return self.proc.log_text()[-3000:] if self.proc is not None else ""

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)
