"""Each exec's egress bytes: the token in its proxy URL (`Proxy-Authorization: Basic`), read by
the proxy and never forwarded, mapped by the service to that exec of that incarnation only, and
accounting only (an unknown or malformed token decides as no token does)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
from aiohttp import web

from agentic_sandbox.agent.egress import proxy_env
from agentic_sandbox.broker.egress.limits import InstanceLimits
from agentic_sandbox.broker.egress.proxy import Outcome, ProxyConnection, SocketPipe
from agentic_sandbox.broker.egress.resolver import HostsFileResolver
from agentic_sandbox.broker.egress.service import EgressService, Requester
from agentic_sandbox.provision.egress_rules import EgressConfig
from tests.support.egress_service import Recorder, egress_service
from tests.unit.egress.test_proxy import request

INC = "0b7e3c1e-6a8f-4e5e-9a55-2f3c1d0e9b11"


def basic(login: str, password: str = "") -> str:
    return "Basic " + base64.b64encode(f"{login}:{password}".encode()).decode()


# ---- the proxy reads the login and drops the header ----------------------------------------------
@pytest.fixture
async def upstream() -> AsyncIterator[int]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"via={request.headers.get('Proxy-Authorization', '-')}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await runner.cleanup()


async def proxied(
    tmp: Path, allow: list[str], target: str, headers: list[tuple[str, str]]
) -> tuple[int, bytes, Outcome, list[str]]:
    """One request through a ProxyConnection: (status, body, outcome, logins seen at the head)."""
    hosts = tmp / "hosts"
    hosts.write_text("127.0.0.1 up.test\n")
    config = EgressConfig.model_validate({"allow": allow})
    seen: list[str] = []
    outcomes: list[Outcome] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ProxyConnection(
            SocketPipe(reader, writer),
            config=lambda: config,
            resolver=HostsFileResolver(hosts),
            limits=InstanceLimits(8, 0),
            on_request=lambda out: seen.append(out.account),
        )
        outcomes.append(await conn.run())

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        resp, body = await request(port, "GET", target, headers=headers)
        async with asyncio.timeout(10):
            while not outcomes:
                await asyncio.sleep(0.01)
    finally:
        server.close()
        await server.wait_closed()
    return resp.status_code, body, outcomes[0], seen


async def test_the_login_is_read_and_not_forwarded(tmp_path: Path, upstream: int) -> None:
    allow = [f"up.test:{upstream}", f"127.0.0.1:{upstream}"]
    status, body, out, seen = await proxied(
        tmp_path,
        allow,
        f"http://up.test:{upstream}/",
        [("Proxy-Authorization", basic("run", "ab1"))],
    )
    assert (status, body, out.verdict) == (200, b"via=-", "allowed")
    assert out.account == "ab1" and seen == ["ab1"]


@pytest.mark.parametrize(
    "value",
    [
        "Basic !!notbase64",
        "Bearer run:x",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        basic("someone", "ab1"),  # not the run login
        basic("run", "\x01"),
    ],
)
async def test_a_malformed_login_decides_as_none(tmp_path: Path, upstream: int, value: str) -> None:
    allow = [f"up.test:{upstream}", f"127.0.0.1:{upstream}"]
    status, body, out, seen = await proxied(
        tmp_path, allow, f"http://up.test:{upstream}/", [("Proxy-Authorization", value)]
    )
    assert (status, body, out.verdict, out.account, seen) == (200, b"via=-", "allowed", "", [""])


async def test_a_login_is_no_permission(tmp_path: Path, upstream: int) -> None:
    status, _, out, seen = await proxied(
        tmp_path, [], f"http://up.test:{upstream}/", [("Proxy-Authorization", basic("run", "ab1"))]
    )
    assert (status, out.verdict, out.reason, seen) == (403, "denied", "not-allowed", ["ab1"])


# ---- the service maps tokens to execs ------------------------------------------------------------
@pytest.fixture
def egress(tmp_path: Path) -> EgressService:
    return egress_service(tmp_path)[0]


def audit_of(egress: EgressService) -> Recorder:
    return cast(Recorder, egress.svc.audit)


def ended(up: int, down: int) -> Outcome:
    return Outcome(verdict="allowed", kind="connect", host="up.test", bytes_up=up, bytes_down=down)


async def test_a_token_names_its_exec_of_its_incarnation_only(egress: EgressService) -> None:
    me = Requester("box-1", INC)
    token = egress.begin_exec("box-1", INC, "exec-a")
    other = egress.begin_exec("box-1", INC, "exec-b")
    assert token != other and len(token) == 32
    assert egress.claim_exec(Requester("box-2", INC), token) is None  # another instance
    assert egress.claim_exec(Requester("box-1", "another-incarnation"), token) is None
    assert egress.claim_exec(me, "0123") is None  # unknown
    assert egress.claim_exec(me, "") is None
    account = egress.claim_exec(me, token)
    assert account is not None and account.exec_id == "exec-a"
    egress.record(me, ended(100, 2000), ("task-1", "run-1"), account)
    unclaimed = ended(7, 9)
    egress.record(me, unclaimed, ("task-1", "run-1"))  # no token: the task run's, as before
    assert await egress.end_exec(token) == (100, 2000)
    assert await egress.end_exec(other) == (0, 0)
    assert egress.run_bytes("run-1") == (7, 9)  # the exec's bytes are not the task run's too
    assert egress.claim_exec(me, token) is None  # forgotten at its end
    rows = [kw["detail"] for _, kw in audit_of(egress).items]
    assert rows[0]["exec_id"] == "exec-a" and "run_id" not in rows[0]
    assert rows[1]["run_id"] == "run-1" and "exec_id" not in rows[1]


async def test_the_end_waits_a_moment_for_open_connections(egress: EgressService) -> None:
    me = Requester("box-1", INC)
    token = egress.begin_exec("box-1", INC, "exec-a")
    account = egress.claim_exec(me, token)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, lambda: egress.record(me, ended(10, 20), None, account))
    assert await egress.end_exec(token, settle=10) == (10, 20)
    # one that stays open past the settle time counts in its audit row only
    token = egress.begin_exec("box-1", INC, "exec-c")
    held = egress.claim_exec(me, token)
    assert held is not None
    assert await egress.end_exec(token, settle=0.05) == (0, 0)
    egress.record(me, ended(5, 5), None, held)  # ends later: recorded, counted nowhere else
    assert audit_of(egress).items[-1][1]["detail"]["exec_id"] == "exec-c"


async def test_dropped_execs_are_forgotten(egress: EgressService) -> None:
    token = egress.begin_exec("box-1", INC, "exec-a")
    egress.drop_exec(token)
    assert egress.claim_exec(Requester("box-1", INC), token) is None


def test_the_agent_puts_the_token_in_every_proxy_setting() -> None:
    env = proxy_env("127.0.0.1:3128", "ab12")
    url = "http://run:ab12@127.0.0.1:3128"
    for key in ("http_proxy", "HTTPS_PROXY", "PIP_PROXY", "npm_config_https_proxy"):
        assert env[key] == url, key
    assert (env["GIT_CONFIG_KEY_0"], env["GIT_CONFIG_VALUE_0"]) == ("http.proxy", url)
    plain = proxy_env("127.0.0.1:3128")
    assert plain["http_proxy"] == "http://127.0.0.1:3128" and "PIP_PROXY" not in plain
