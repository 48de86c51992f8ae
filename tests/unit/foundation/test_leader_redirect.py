"""The follower's answers, on a real aiohttp server: flagged reads served, everything else 307
to the leader (path and query kept, problem+json), 503 + Retry-After while nobody leads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agentic_sandbox.broker.cluster import LeaderInfo, NodeInfo, Role
from agentic_sandbox.broker.http.leader import leader_middleware
from agentic_sandbox.broker.http.problems import problem_middleware
from agentic_sandbox.broker.http.routing import ApiRoutes, Call, NoBody, NoQuery
from agentic_sandbox.broker.services import SERVICES
from tests.support.inproc_server import free_port

api = ApiRoutes()


@api.get("/api/things", role=None, summary="a read", tag="t", follower=True)
async def read(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    return web.json_response({"served": "here"})


@api.post("/api/things", role=None, summary="a write", tag="t")
async def write(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    return web.json_response({"written": "here"}, status=201)


@api.get("/api/held", role=None, summary="leader memory", tag="t")
async def held(call: Call[NoBody, NoQuery]) -> web.StreamResponse:
    return web.json_response({"held": "here"})


@dataclass
class FakeCluster:
    role: Role
    leader: LeaderInfo | None
    me: NodeInfo
    term: int | None = 3


@pytest.fixture
async def follower() -> AsyncIterator[tuple[str, Any]]:
    svc = SimpleNamespace(
        leading=False,
        cluster=FakeCluster(
            Role.follower,
            LeaderInfo("n1", "http://leader.example:8122", "x:1"),
            NodeInfo("n2", "http://127.0.0.1:1", "y:1", "t"),
        ),
    )
    app = web.Application(middlewares=[problem_middleware, leader_middleware])
    app[SERVICES] = svc  # type: ignore[assignment]  # the middleware reads two fields
    api.install(app)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", svc
    finally:
        await runner.cleanup()


async def test_follower_serves_flagged_reads_and_redirects_the_rest(
    follower: tuple[str, Any],
) -> None:
    url, svc = follower
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/api/things") as r:
            assert r.status == 200 and await r.json() == {"served": "here"}
        async with http.post(url + "/api/things?a=1&b=%20", allow_redirects=False) as r:
            assert r.status == 307
            assert r.headers["Location"] == "http://leader.example:8122/api/things?a=1&b=%20"
            assert r.headers["Sandbox-Leader"] == "n1 http://leader.example:8122"
            assert r.content_type == "application/problem+json"
            doc = await r.json(content_type=None)
            assert doc["type"].endswith("not-leader") and doc["status"] == 307
            assert doc["leader_url"] == "http://leader.example:8122" and "n1" in doc["detail"]
        async with http.get(url + "/api/held", allow_redirects=False) as r:
            assert r.status == 307
        async with http.get(url + "/api/nothing-here", allow_redirects=False) as r:
            assert r.status == 404  # unknown paths are not redirected

        svc.cluster.leader = None  # nobody leads: retry shortly
        async with http.post(url + "/api/things", allow_redirects=False) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            doc = await r.json(content_type=None)
            assert doc["type"].endswith("no-leader")
        async with http.get(url + "/api/things") as r:
            assert r.status == 200  # reads go on

        svc.cluster.role = Role.leader  # elected, components still starting
        async with http.post(url + "/api/things", allow_redirects=False) as r:
            assert r.status == 503
        svc.leading = True  # serving as the leader: everything here
        async with http.post(url + "/api/things", allow_redirects=False) as r:
            assert r.status == 201 and await r.json() == {"written": "here"}
