"""Ports in the real `isolated` guest of the exec e2e (the same guest: `conftest.py`): a web
server started in the guest through exec (`python3 -m http.server` on the guest's loopback —
the guest has no inbound forward) answers through the reverse proxy and through port
forwarding, over the agent link alone; a port nothing listens on is `connection-refused`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from agentic_sandbox import AsyncClient
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
MiB = 1024 * 1024
PORT = 8765
ROOT = "/var/tmp/e2e-ports"


async def _drain(lines: AsyncIterator[dict[str, Any]], seen: list[dict[str, Any]]) -> None:
    async for line in lines:
        seen.append(line)


async def test_a_web_server_in_the_guest_answers_through_the_proxy_and_port_forward(
    server: ServerProcess, guest: str
) -> None:
    inst = server.ok("GET", f"/api/v2/admin/instances/{guest}")
    assert inst["network_policy"] == "isolated"
    auth = {"Authorization": f"Bearer {server.admin_token}"}
    base = f"{server.url}/api/v2/admin/instances/{guest}/ports/{PORT}/"
    async with AsyncClient(server.url, server.admin_token, timeout=300) as sbx:
        made = await sbx.instances.exec(
            guest,
            [
                "sh",
                "-c",
                f"mkdir -p {ROOT} && echo hello-from-the-guest > {ROOT}/index.txt && "
                f"head -c {8 * MiB} /dev/urandom > {ROOT}/blob && sha256sum {ROOT}/blob",
            ],
        )
        assert made.exit_code == 0, made
        digest = made.stdout.data.split()[0]
        seen: list[dict[str, Any]] = []
        lines = sbx.instances.exec_stream(
            guest,
            ["python3", "-m", "http.server", str(PORT), "--bind", "127.0.0.1", "--directory", ROOT],
            timeout_seconds=900,
        )
        web = asyncio.ensure_future(_drain(lines, seen))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
                # the server needs a moment to listen (a TCG guest): refused until it does
                deadline = time.monotonic() + 120
                while True:
                    async with http.get(base + "index.txt", headers=auth) as resp:
                        body = await resp.read()
                        if resp.status == 200:
                            break
                        refused = resp.status == 502 and b"connection-refused" in body
                        assert refused, (body, server.log_tail(120))
                    assert not web.done(), (seen, server.log_tail(120))
                    assert time.monotonic() < deadline, "the guest's web server never answered"
                    await asyncio.sleep(0.5)
                assert body == b"hello-from-the-guest\n"

                t0 = time.monotonic()
                async with http.get(base + "blob", headers=auth) as resp:
                    assert resp.status == 200
                    blob = await resp.read()
                proxy_s = time.monotonic() - t0
                assert hashlib.sha256(blob).hexdigest() == digest

                async with await sbx.instances.port_forward(guest, PORT) as fwd:
                    local = f"http://127.0.0.1:{fwd.address[1]}/"
                    async with http.get(local + "index.txt") as resp:
                        assert (resp.status, await resp.read()) == (200, b"hello-from-the-guest\n")
                    t0 = time.monotonic()
                    async with http.get(local + "blob") as resp:
                        blob = await resp.read()
                    forward_s = time.monotonic() - t0
                    assert hashlib.sha256(blob).hexdigest() == digest
                    assert not fwd.failures

                async with http.get(
                    f"{server.url}/api/v2/admin/instances/{guest}/ports/{PORT + 1}/", headers=auth
                ) as resp:
                    assert (
                        resp.status == 502 and (await resp.json())["code"] == "connection-refused"
                    )
            print(
                f"\nguest ports: proxy {8 * MiB / proxy_s / 1e6:.1f} MB/s, port-forward "
                f"{8 * MiB / forward_s / 1e6:.1f} MB/s (8 MiB, TCG, load {os.getloadavg()})"
            )
        finally:
            web.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await web
            with contextlib.suppress(Exception):
                await lines.aclose()  # type: ignore[attr-defined]
        # the exec's end stopped the web server; the guest is still answering
        after = await sbx.instances.exec(guest, ["sh", "-c", f"rm -rf {ROOT}; echo ok"])
        assert after.stdout.data == "ok\n"
