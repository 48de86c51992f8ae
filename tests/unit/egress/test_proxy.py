"""One proxied connection, over loopback sockets: plain HTTP forwarding and CONNECT tunnels
against servers of the test's own, refusals with their reasons, limits, and bytes counted.

Loopback is refused unless a rule names the address, so the rules here name 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import h11
import pytest
from aiohttp import web

from agentic_sandbox.broker.egress.limits import InstanceLimits
from agentic_sandbox.broker.egress.proxy import Outcome, ProxyConnection, SocketPipe
from agentic_sandbox.broker.egress.resolver import HostsFileResolver
from agentic_sandbox.provision.egress_rules import EgressConfig


class Proxy:
    def __init__(self, tmp: Path) -> None:
        self.hosts = tmp / "hosts"
        self.hosts.write_text("127.0.0.1 up.test other.test\n")
        self.config = EgressConfig()
        self.limits = InstanceLimits(8, 0)
        self.outcomes: list[Outcome] = []
        self.done = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    def allow(self, *rules: str, **limits: int) -> None:
        self.config = EgressConfig.model_validate({"allow": list(rules), "limits": limits})
        self.limits.configure(self.config.limits.max_connections, 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ProxyConnection(
            SocketPipe(reader, writer),
            config=lambda: self.config,
            resolver=HostsFileResolver(self.hosts),
            limits=self.limits,
        )
        self.outcomes.append(await conn.run())
        self.done.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def outcome(self, n: int = 1) -> Outcome:
        async with asyncio.timeout(10):
            while len(self.outcomes) < n:
                self.done.clear()
                await self.done.wait()
        return self.outcomes[n - 1]


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    p = Proxy(tmp_path)
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def upstream() -> AsyncIterator[int]:
    async def hello(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(
            text=f"{request.method} {request.path_qs} host={request.host} "
            f"via={request.headers.get('Proxy-Authorization', '-')} body={len(body)}"
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield port
    await runner.cleanup()


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data.upper())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def request(
    port: int,
    method: str,
    target: str,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
) -> tuple[h11.Response, bytes]:
    """One request to the proxy, read with h11 as a client would."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    hdrs = [("host", "proxy"), ("content-length", str(len(body))), *(headers or [])]
    writer.write(conn.send(h11.Request(method=method, target=target, headers=hdrs)))
    writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    await writer.drain()
    response: h11.Response | None = None
    out = b""
    async with asyncio.timeout(10):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                continue
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                out += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    writer.close()
    assert response is not None
    return response, out


def header(resp: h11.Response, name: bytes) -> bytes | None:
    return next((v for k, v in resp.headers if k == name), None)


async def test_plain_http_is_forwarded_in_origin_form(proxy: Proxy, upstream: int) -> None:
    proxy.allow(f"up.test:{upstream}", f"127.0.0.1:{upstream}")
    resp, body = await request(
        proxy.port,
        "POST",
        f"http://UP.test.:{upstream}/a/b?c=1",
        b"x" * 100_000,
        [("proxy-authorization", "Basic c2VjcmV0"), ("connection", "keep-alive")],
    )
    assert resp.status_code == 200
    assert body.decode() == f"POST /a/b?c=1 host=up.test:{upstream} via=- body=100000"
    assert header(resp, b"connection") == b"close"
    out = await proxy.outcome()
    assert (out.verdict, out.kind, out.host, out.address, out.status) == (
        "allowed",
        "http",
        "up.test",
        "127.0.0.1",
        200,
    )
    assert out.bytes_up > 100_000 and out.bytes_down > len(body)


async def test_connect_tunnels_bytes_untouched(proxy: Proxy, echo: int) -> None:
    proxy.allow(f"up.test:{echo}", f"127.0.0.1:{echo}")
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(f"CONNECT up.test:{echo} HTTP/1.1\r\nHost: up.test:{echo}\r\n\r\nearly".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200 ")
    writer.write(b" and late")
    await writer.drain()
    got = b""
    async with asyncio.timeout(10):
        while len(got) < len(b"EARLY AND LATE"):
            got += await reader.read(100)
    assert got == b"EARLY AND LATE"
    writer.close()
    out = await proxy.outcome()
    assert (out.verdict, out.kind, out.status, out.address) == (
        "allowed",
        "connect",
        200,
        "127.0.0.1",
    )
    assert out.bytes_down == len(head) + len(got)


@pytest.mark.parametrize(
    ("rules", "method", "target", "status", "reason"),
    [
        ((), "GET", "http://up.test:{p}/", 403, "not-allowed"),
        (("other.test:{p}",), "GET", "http://up.test:{p}/", 403, "not-allowed"),
        # allowed by name, but the name resolves to loopback that no rule names: rebinding
        (("up.test:{p}",), "CONNECT", "up.test:{p}", 403, "address-loopback"),
        (("up.test:{p}",), "GET", "http://up.test:{p}/", 403, "address-loopback"),
        (
            ("up.test:{p}:GET", "127.0.0.1:{p}"),
            "POST",
            "http://up.test:{p}/",
            403,
            "method-not-allowed",
        ),
        (("*.test:{p}",), "GET", "http://169.254.169.254/latest/meta-data", 403, "not-allowed"),
        (("*.test:{p}",), "GET", "http://nowhere.test:{p}/", 403, "unresolvable"),
        (("*.test:{p}",), "GET", "/relative", 400, "bad-request"),
        (("*.test:{p}",), "GET", "https://up.test/", 400, "bad-request"),
        (("*.test:{p}",), "CONNECT", "up.test", 400, "bad-request"),
    ],
)
async def test_refusals_answer_at_once_with_the_reason(
    proxy: Proxy,
    upstream: int,
    rules: tuple[str, ...],
    method: str,
    target: str,
    status: int,
    reason: str,
) -> None:
    proxy.allow(*(r.format(p=upstream) for r in rules))
    resp, body = await request(proxy.port, method, target.format(p=upstream))
    assert resp.status_code == status
    assert header(resp, b"x-egress-reason") == reason.encode()
    assert reason in body.decode()
    out = await proxy.outcome()
    assert (out.verdict, out.reason) == ("denied", reason)


async def test_upstream_down_is_a_failure_not_a_hang(proxy: Proxy, upstream: int) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    proxy.allow(f"up.test:{dead}", f"127.0.0.1:{dead}")
    resp, _ = await request(proxy.port, "GET", f"http://up.test:{dead}/")
    assert resp.status_code == 502
    out = await proxy.outcome()
    assert (out.verdict, out.reason) == ("failed", "upstream-unreachable")


async def test_connection_limit_refuses_with_a_reason(
    proxy: Proxy, echo: int, upstream: int
) -> None:
    proxy.allow(f"up.test:{echo}", f"127.0.0.1:{echo}", f"127.0.0.1:{upstream}", max_connections=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(f"CONNECT 127.0.0.1:{echo} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
    resp, body = await request(proxy.port, "GET", f"http://127.0.0.1:{upstream}/")
    assert resp.status_code == 429
    assert header(resp, b"x-egress-reason") == b"connection-limit"
    assert "the limit is 1" in body.decode()
    writer.close()
    await proxy.outcome(2)
    assert [o.reason for o in proxy.outcomes] == ["connection-limit", ""]
    # the tunnel's slot is free again once it ended
    async with asyncio.timeout(10):
        while proxy.limits.active:
            await asyncio.sleep(0.01)
    resp, _ = await request(proxy.port, "GET", f"http://127.0.0.1:{upstream}/")
    assert resp.status_code == 200


async def test_a_rule_change_applies_to_the_next_connection(proxy: Proxy, upstream: int) -> None:
    proxy.allow(f"127.0.0.1:{upstream}")
    assert (await request(proxy.port, "GET", f"http://127.0.0.1:{upstream}/"))[0].status_code == 200
    proxy.allow()
    resp, _ = await request(proxy.port, "GET", f"http://127.0.0.1:{upstream}/")
    assert resp.status_code == 403


async def test_garbage_is_a_bad_request(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"\x16\x03\x01\x02\x00 not http\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    assert data.startswith(b"HTTP/1.1 400 ")
    assert b"x-egress-reason: bad-request" in data
    out = await proxy.outcome()
    assert (out.verdict, out.reason) == ("denied", "bad-request")
