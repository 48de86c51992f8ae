"""A flood of refused requests cannot fill the audit log: refusals are rate-limited per remote
address before they are audited (429 with Retry-After on HTTP, RESOURCE_EXHAUSTED on gRPC
Enroll), and repeated ones become one summary row and event with a count — which adds up to
every refusal, so nothing is lost. The server's default limits; its shutdown writes the last
summaries, so the counts are read after a restart."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(180)

HTTP_FLOOD = 1000
ENROLL_FLOOD = 200
SERVER_NAME = "agentic-sandbox-server"


async def http_flood(server: ServerProcess) -> Counter[int]:
    statuses: Counter[int] = Counter()
    retry_after: set[str] = set()
    connector = aiohttp.TCPConnector(limit=32)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> None:
            bad = {"Authorization": "Bearer sbx_" + secrets.token_urlsafe(32)}
            async with http.get(f"{server.url}/api/v2/admin/whoami", headers=bad) as resp:
                statuses[resp.status] += 1
                if resp.status == 429:
                    retry_after.add(resp.headers.get("Retry-After", ""))
                    assert (await resp.json())["code"] == "rate-limited"

        await asyncio.gather(*(one() for _ in range(HTTP_FLOOD)))
    assert retry_after and all(v.isdigit() and int(v) >= 1 for v in retry_after), retry_after
    return statuses


async def enroll_flood(server: ServerProcess) -> Counter[str]:
    codes: Counter[str] = Counter()
    creds = grpc.ssl_channel_credentials(root_certificates=server.ca_path.read_bytes())
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    async with grpc.aio.secure_channel(server.enroll_target, creds, options=options) as ch:
        stub = pb_grpc.AgentLinkStub(ch)
        sem = asyncio.Semaphore(16)

        async def one() -> None:
            async with sem:
                try:
                    await stub.Enroll(
                        pb.EnrollRequest(instance_id="nobody", token="sbe_" + "x" * 43), timeout=20
                    )
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1

        await asyncio.gather(*(one() for _ in range(ENROLL_FLOOD)))
    return codes


def denied_rows(server: ServerProcess) -> list[dict[str, Any]]:
    out = server.ok("GET", "/api/v2/admin/audit?outcome=denied&limit=1000")
    items: list[dict[str, Any]] = out["items"]
    return items


def events(server: ServerProcess, type_: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = server.ok("GET", f"/api/v1/events?type={type_}&limit=200")[
        "items"
    ]
    return items


def count(row: dict[str, Any]) -> int:
    return int((row.get("detail") or row.get("data") or {}).get("count", 1))


async def test_floods_are_rate_limited_and_aggregated(tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "srv", env={"SANDBOX_AGENT_HEARTBEAT_SECONDS": "0.5"}
    ).start()  # the default refusal limits
    try:
        statuses = await http_flood(server)
        codes = await enroll_flood(server)
        # Past the address's allowance (20 by default) refusals are answered 429 / exhausted.
        assert statuses[401] + statuses[429] == HTTP_FLOOD, statuses
        assert 0 < statuses[401] <= 40 and statuses[429] >= HTTP_FLOOD - 40, statuses
        assert codes["PERMISSION_DENIED"] + codes["RESOURCE_EXHAUSTED"] == ENROLL_FLOOD, codes
        assert codes["RESOURCE_EXHAUSTED"] >= ENROLL_FLOOD - 40, codes
        # A valid credential from the same address is not locked out.
        assert server.api("GET", "/api/v2/admin/whoami")[0] == 200
        server.stop()  # writes the summaries of the open windows
        server.start()

        http_rows = [r for r in denied_rows(server) if r["actor"].startswith("anonymous@")]
        enroll_rows = [r for r in denied_rows(server) if r["action"].startswith("agent.")]
        assert len(http_rows) == 2, http_rows  # the first refusal, then one summary
        assert sum(count(r) for r in http_rows) == HTTP_FLOOD
        assert len(enroll_rows) == 2, enroll_rows
        assert sum(count(r) for r in enroll_rows) == ENROLL_FLOOD
        summary = next(r for r in http_rows if count(r) > 1)
        assert summary["detail"]["rate_limited"] == statuses[429]

        denied = events(server, "auth.denied")
        refused = events(server, "agent.refused")
        assert len(denied) == 2 and sum(count(e) for e in denied) == HTTP_FLOOD
        assert len(refused) == 2 and sum(count(e) for e in refused) == ENROLL_FLOOD
    finally:
        server.stop()
