"""An in-process sandbox-server (foundation only: no fleet, no agent link) on a free port.

The `running` fixture is registered for every tier by `tests/conftest.py`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentic_sandbox.broker.app import Component
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.server import Server
from agentic_sandbox.broker.services import Services
from tests.support.server import free_port


@dataclass
class Running:
    url: str
    admin_token: str
    svc: Services
    server: Server
    http: aiohttp.ClientSession

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.admin_token}"}

    async def call(
        self, method: str, path: str, token: str | None = None, **kw: Any
    ) -> tuple[int, Any, aiohttp.ClientResponse]:
        headers = kw.pop("headers", {})
        if token != "":
            headers = {**self.auth(token), **headers}
        async with self.http.request(method, self.url + path, headers=headers, **kw) as resp:
            raw = await resp.read()
            body: Any = raw
            if resp.content_type in ("application/json", "application/problem+json"):
                body = await resp.json(content_type=None)
            return resp.status, body, resp

    async def make_token(self, subject: str, role: str) -> str:
        status, body, _ = await self.call(
            "POST", "/api/v2/admin/tokens", json={"subject": subject, "role": role}
        )
        assert status == 201, body
        token: str = body["token"]
        return token


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "http_listen": f"127.0.0.1:{free_port()}",
        "grpc_listen": f"127.0.0.1:{free_port()}",
        "grpc_enroll_listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": f"127.0.0.1:{free_port()}",
        "guest_link_listen": f"127.0.0.1:{free_port()}",
        "libvirt_uri": "",
        "log_format": "json",
        "max_body_bytes": 64 * 1024,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    async with start_server(make_settings(tmp_path)) as r:
        yield r


class start_server:
    def __init__(
        self,
        settings: Settings,
        components: Callable[[Services], list[Component]] | None = None,
    ) -> None:
        self.settings = settings
        self.components = components or (lambda svc: [])

    async def __aenter__(self) -> Running:
        self.server = Server(self.settings, component_factory=self.components)
        svc = await self.server.start()
        # on PostgreSQL it starts as a follower: wait for it to lead (it is the only node)
        await asyncio.wait_for(self.server.leading.wait(), 30)
        token = self.settings.effective_admin_token_file.read_text().strip()
        self.http = aiohttp.ClientSession()
        host, port = self.settings.http_address
        return Running(f"http://{host}:{port}", token, svc, self.server, self.http)

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()
        await self.server.stop()
        await asyncio.sleep(0)
