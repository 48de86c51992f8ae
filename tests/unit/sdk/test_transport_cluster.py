"""The SDK's Transport over several nodes, against real HTTP servers on loopback: a 307 is
re-sent with its method, body and token only to a listed origin or a leader a listed node's
/readyz names, at most 3 hops; the leader is remembered; an unreachable node is skipped; a
leaderless moment (503 no-leader) is waited out."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from agentic_sandbox.sdk import RedirectRefused
from agentic_sandbox.sdk.contexts import Credentials
from agentic_sandbox.sdk.transport import Transport


@dataclass
class Node:
    """A pretend control host: `leads`, or redirects every /api request to `redirect_to`."""

    name: str
    redirect_to: str | None = None  # base URL its 307s point at
    advertises: str | None = None  # the leader its /readyz names
    no_leader_first: int = 0  # answer 503 no-leader this many times first
    seen: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    async def readyz(self, request: web.Request) -> web.Response:
        if self.redirect_to is None:
            return web.json_response({"role": "leader", "node": self.name, "leader": None})
        leader = {"node": "l", "url": self.advertises} if self.advertises else None
        return web.json_response({"role": "follower", "node": self.name, "leader": leader})

    async def api(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(
            {
                "method": request.method,
                "path": request.path_qs,
                "auth": request.headers.get("Authorization"),
                "body": body.decode(),
            }
        )
        if self.no_leader_first:
            self.no_leader_first -= 1
            return web.json_response(
                {"type": "about:blank#no-leader", "code": "no-leader", "status": 503},
                status=503,
                headers={"Retry-After": "1"},
                content_type="application/problem+json",
            )
        if self.redirect_to is not None:
            return web.json_response(
                {"code": "not-leader", "leader_url": self.redirect_to},
                status=307,
                headers={"Location": self.redirect_to + request.path_qs},
                content_type="application/problem+json",
            )
        return web.json_response({"node": self.name, "got": json.loads(body or b"null")})

    async def start(self) -> Node:
        app = web.Application()
        app.router.add_get("/readyz", self.readyz)
        app.router.add_route("*", "/api/{tail:.*}", self.api)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in made:
        await n.stop()


async def node(nodes: list[Node], name: str, **kw: Any) -> Node:
    n = await Node(name, **kw).start()
    nodes.append(n)
    return n


async def test_a_307_to_the_advertised_leader_is_resent_with_body_and_token(
    nodes: list[Node],
) -> None:
    leader = await node(nodes, "leader")
    follower = await node(nodes, "follower", redirect_to=leader.url, advertises=leader.url)
    t = Transport([follower.url], "tok")  # only the follower is listed
    try:
        got = await t.request("POST", "/api/things", json_body={"a": 1}, params={"x": "1"})
        assert got == {"node": "leader", "got": {"a": 1}}
        assert leader.seen == [
            {"method": "POST", "path": "/api/things?x=1", "auth": "Bearer tok", "body": '{"a": 1}'}
        ]
        assert t.url == leader.url  # remembered: the next write goes straight there
        await t.request("PUT", "/api/other", json_body=[2])
        assert len(follower.seen) == 1 and leader.seen[-1]["method"] == "PUT"
    finally:
        await t.close()


async def test_a_307_to_an_origin_nobody_named_is_refused_and_not_sent(
    nodes: list[Node],
) -> None:
    leader = await node(nodes, "leader")
    evil = await node(nodes, "evil")
    # it names the real leader in /readyz but redirects elsewhere
    follower = await node(nodes, "follower", redirect_to=evil.url, advertises=leader.url)
    t = Transport([follower.url, leader.url], "secret")
    try:
        with pytest.raises(RedirectRefused, match="not one of this client's servers"):
            await t.request("POST", "/api/things", json_body={"a": 1})
        assert evil.seen == [] and leader.seen == []
    finally:
        await t.close()


async def test_at_most_three_hops(nodes: list[Node]) -> None:
    a = await node(nodes, "a")
    b = await node(nodes, "b")
    a.redirect_to, b.redirect_to = b.url, a.url  # each says the other leads
    t = Transport(f"{a.url},{b.url}", "tok")
    try:
        with pytest.raises(RedirectRefused, match="more than 3 redirects"):
            await t.request("DELETE", "/api/x")
        assert len(a.seen) + len(b.seen) == 4  # the request and 3 re-sends
    finally:
        await t.close()


async def test_an_unreachable_node_is_skipped_and_the_next_serves(nodes: list[Node]) -> None:
    leader = await node(nodes, "leader")
    t = Transport([dead_url(), leader.url], "tok")
    try:
        assert (await t.request("POST", "/api/x", json_body=1))["node"] == "leader"
        assert t.url == leader.url
        assert await t.resolve_leader() == leader.url
    finally:
        await t.close()


async def test_a_leaderless_moment_is_waited_out(nodes: list[Node]) -> None:
    leader = await node(nodes, "leader", no_leader_first=1)
    t = Transport([leader.url], "tok")
    try:
        assert (await t.request("POST", "/api/x", json_body=1))["got"] == 1
        assert len(leader.seen) == 2
    finally:
        await t.close()


async def test_resolve_leader_asks_the_followers(nodes: list[Node]) -> None:
    leader = await node(nodes, "leader")
    follower = await node(nodes, "follower", redirect_to=leader.url, advertises=leader.url)
    t = Transport([dead_url(), follower.url], "tok")
    try:
        assert await t.resolve_leader() == leader.url
        assert t.ws_url == leader.url.replace("http://", "ws://")
    finally:
        await t.close()


def test_several_urls_from_the_environment_and_a_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("SANDBOX_CONTEXT", raising=False)
    monkeypatch.setenv("SANDBOX_URL", "http://a:1/, http://b:2")
    assert Credentials.resolve(token="t").url == "http://a:1,http://b:2"
    assert Transport(Credentials.resolve(token="t").url, "t").urls == ["http://a:1", "http://b:2"]
    monkeypatch.delenv("SANDBOX_URL")
    cfg = tmp_path / "agentic-sandbox"
    cfg.mkdir()
    (cfg / "sandboxctl.yaml").write_text(
        "current-context: c\ncontexts:\n  c:\n    servers: [http://x:1, http://y:2/]\n"
    )
    assert Credentials.resolve(token="t").url == "http://x:1,http://y:2"
