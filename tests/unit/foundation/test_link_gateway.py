"""The guest link gateway tells guest connections apart inside one pipe (what a QEMU guest
forward gives the host: one connection carrying every guest connection in turn)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentic_sandbox.agent.config import AgentConfig
from agentic_sandbox.broker.agentlink.gateway import (
    ESTABLISHED,
    RESET,
    ConnectRequest,
    GatewayBindError,
    LinkGateway,
    Upstreams,
    parse_connect,
)

LINK = b"CONNECT link.agentic-sandbox.invalid:443 HTTP/1.1\r\nHost: x\r\n\r\n"
ENROLL = b"CONNECT enroll.agentic-sandbox.invalid:443 HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass
class Upstream:
    """A stand-in for one gRPC listener: records every connection and what it received, and
    answers each chunk with `<name>:<chunk>`."""

    name: str
    received: list[bytearray] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    server: asyncio.Server | None = None

    async def start(self) -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            index = len(self.received)
            self.received.append(bytearray())
            while data := await reader.read(65536):
                self.received[index] += data
                writer.write(self.name.encode() + b":" + data)
                await writer.drain()
            self.closed.append(index)
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[LinkGateway, int, Upstream, Upstream]]:
    link, enroll = Upstream("link"), Upstream("enroll")
    gw = LinkGateway(
        Upstreams(
            link=("127.0.0.1", await link.start()), enroll=("127.0.0.1", await enroll.start())
        )
    )
    port = await gw.start(["127.0.0.1"], 0)
    yield gw, port, link, enroll
    await gw.stop()
    for up in (link, enroll):
        assert up.server is not None
        up.server.close()


async def _read_exactly(reader: asyncio.StreamReader, data: bytes) -> None:
    got = await asyncio.wait_for(reader.readexactly(len(data)), 5)
    assert got == data


async def _until(pred: object, what: str) -> None:
    async with asyncio.timeout(5):
        while not pred():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_a_new_pipe_first_ends_a_stale_guest_connection(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    _gw, port, link, _enroll = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _read_exactly(reader, RESET)  # what a guest connection open across a restore reads
    # the stale connection's bytes are dropped; the next CONNECT starts a fresh one
    writer.write(b"\x17\x03\x03\x00\x05stale" + LINK + b"hello")
    await _read_exactly(reader, ESTABLISHED)
    await _read_exactly(reader, b"link:hello")
    assert bytes(link.received[0]) == b"hello"
    writer.close()


async def test_a_connect_inside_a_spliced_stream_starts_a_new_upstream(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    gw, port, link, enroll = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _read_exactly(reader, RESET)
    writer.write(ENROLL + b"csr")
    await _read_exactly(reader, ESTABLISHED)
    await _read_exactly(reader, b"enroll:csr")
    # the agent closed its enrollment connection and opened the link: same pipe; the CONNECT
    # arrives split over two writes
    writer.write(b"tail-of-old" + LINK[:5])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(LINK[5:] + b"register")
    # the old connection got the CONNECT's first bytes before they could be told apart (it is
    # closed right after; nothing is held back waiting for the next chunk)
    await _read_exactly(reader, b"enroll:tail-of-old" + LINK[:5])
    await _read_exactly(reader, ESTABLISHED)
    await _read_exactly(reader, b"link:register")
    await _until(lambda: enroll.closed == [0], "the old upstream to close")
    assert bytes(link.received[0]) == b"register"
    assert gw.metrics_restarts == 1 and gw.metrics_connections == 2
    writer.close()


async def test_unknown_names_are_refused_and_the_pipe_stays_usable(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    _gw, port, _link, _enroll = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _read_exactly(reader, RESET)
    writer.write(b"CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: x\r\n\r\n")
    status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert status.startswith(b"HTTP/1.1 403")
    writer.write(LINK + b"ok")
    await _read_exactly(reader, ESTABLISHED)
    await _read_exactly(reader, b"link:ok")
    writer.close()


async def test_an_upstream_that_ends_ends_the_guests_tls_connection(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    gw, port, _link, _enroll = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _read_exactly(reader, RESET)
    writer.write(LINK + b"x")
    await _read_exactly(reader, ESTABLISHED)
    await _read_exactly(reader, b"link:x")
    (pipe,) = gw.pipes
    assert pipe.upstream is not None and pipe.upstream.transport is not None
    pipe.upstream.transport.close()  # the server ended the connection
    await _read_exactly(reader, RESET)
    writer.close()


async def test_a_listener_that_is_down_answers_503(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    _gw, port, link, _enroll = gateway
    assert link.server is not None
    link.server.close()
    await link.server.wait_closed()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _read_exactly(reader, RESET)
    writer.write(LINK)
    status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert status.startswith(b"HTTP/1.1 503")
    writer.close()


def test_connect_requests_are_parsed_by_h11() -> None:
    assert parse_connect(LINK) == ConnectRequest("link")
    assert parse_connect(ENROLL) == ConnectRequest("enroll")
    sync = b"CONNECT sync.agentic-sandbox.invalid:0 HTTP/1.1\r\nHost: x\r\nsandbox-sync: %s\r\n\r\n"
    assert parse_connect(sync % b"ab12") == ConnectRequest("sync", b"ab12")
    assert parse_connect(sync % b"") is None  # a sync names its nonce
    assert parse_connect(sync % b"a\x01b") is None  # letters and digits only
    assert parse_connect(sync % (b"a" * 65)) is None
    assert parse_connect(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") is None
    assert (
        parse_connect(b"CONNECT evil.agentic-sandbox.invalid:1 HTTP/1.1\r\nHost: x\r\n\r\n") is None
    )
    assert parse_connect(b"CONNECT \x00\x01 garbage\r\n\r\n") is None


async def test_one_gateway_listens_on_several_addresses_at_one_port() -> None:
    """A host's guests reach the gateway at that host's control_address: every address listed
    is bound at the first one's port, and each passes guests on alike."""
    link = Upstream("link")
    gw = LinkGateway(Upstreams(link=("127.0.0.1", await link.start()), enroll=("127.0.0.1", 1)))
    try:
        port = await gw.start(["127.0.0.1", "127.0.0.2"], 0)
        assert sorted(gw.addresses) == [("127.0.0.1", port), ("127.0.0.2", port)]
        for host in ("127.0.0.1", "127.0.0.2"):
            reader, writer = await asyncio.open_connection(host, port)
            await _read_exactly(reader, RESET)
            writer.write(LINK + host.encode())
            await _read_exactly(reader, ESTABLISHED)
            await _read_exactly(reader, b"link:" + host.encode())
            writer.close()
    finally:
        await gw.stop()
        assert link.server is not None
        link.server.close()


async def test_an_address_that_cannot_be_bound_is_named_and_nothing_stays_open() -> None:
    taken = await asyncio.start_server(lambda r, w: None, "127.0.0.2", 0)
    port = taken.sockets[0].getsockname()[1]
    gw = LinkGateway(Upstreams(link=("127.0.0.1", 1), enroll=("127.0.0.1", 1)))
    try:
        with pytest.raises(GatewayBindError, match=rf"127\.0\.0\.2:{port}") as err:
            await gw.start(["127.0.0.1", "127.0.0.2"], port)
        assert err.value.host == "127.0.0.2"
        assert gw.addresses == []
        with pytest.raises(OSError):  # the first address was let go as well
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        taken.close()


async def test_a_sync_drops_what_waited_in_the_pipe_for_the_next_connection(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    """The agent's sync (`agent/channels.py` `sync_forward`) through a guest forward whose
    pipe was made while no guest connection was open: the gateway's reset waits in it, the
    sync reads it and the gateway's answer, and the next connection starts clean."""
    from agentic_sandbox.agent.channels import sync_forward
    from tests.support.guestfwd import GuestForward

    gw, port, _link, _enroll = gateway
    fwd = GuestForward(f"127.0.0.1:{port}").start()
    try:
        await _until(lambda: bytes(fwd.held) == RESET, "the reset waits in the pipe")
        assert await sync_forward(fwd.address) is True
        assert gw.metrics_syncs == 1 and not fwd.held
        reader, writer = await asyncio.open_connection(*fwd.address.split(":"))
        writer.write(LINK + b"ok")
        await _read_exactly(reader, ESTABLISHED)  # not the reset: it was the sync's
        await _read_exactly(reader, b"link:ok")
        writer.close()
    finally:
        await asyncio.to_thread(fwd.stop)


async def test_a_sync_gives_up_on_a_gateway_that_does_not_know_it() -> None:
    """An older server's gateway refuses the sync name with a 403: the agent goes on at once."""
    from agentic_sandbox.agent.channels import sync_forward

    async def old_gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(old_gateway, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        async with asyncio.timeout(2):  # not the sync's 5 s deadline
            assert await sync_forward(f"127.0.0.1:{port}") is False
    finally:
        server.close()


async def test_a_sync_nothing_answers_says_so_and_no_connection_is_made_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No gateway behind the forward (the server is restarting, the port's host side is away):
    the sync says so (`GatewaySilent`, a ConnectionError the agent backs off from) instead of
    letting the connection after it read the next pipe's reset; and the channel it would have
    used is closed."""
    from agentic_sandbox.agent import channels
    from agentic_sandbox.agent.channels import GatewaySilent, sync_forward

    monkeypatch.setattr(channels, "SYNC_TIMEOUT", 0.3)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the request, never answers
        writer.close()

    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    for serve in (silent, hangs_up):
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(GatewaySilent, match=f"127.0.0.1:{port}"):
                await sync_forward(f"127.0.0.1:{port}")
        finally:
            server.close()

    closed: list[bool] = []

    class Channel:
        async def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(channels, "open_channel", lambda *_a: Channel())
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        cfg = AgentConfig(gateway=f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        with pytest.raises(ConnectionError):
            await channels.connect_channel(cfg, None, "link", None)  # type: ignore[arg-type]
        assert closed == [True]
    finally:
        server.close()


class PtyChardev:
    """QEMU's side of the link's virtio-serial port, for tests: a raw PTY whose slave is the
    device the agent's bridge opens, and whose master is pumped to and from one TCP
    connection to the gateway (what the chardev makes)."""

    def __init__(self) -> None:
        import tty

        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)
        self.device = os.ttyname(self.slave)
        self.writer: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task[None] | None = None

    async def connect(self, port: int) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        os.set_blocking(self.master, False)

        def readable() -> None:
            with contextlib.suppress(BlockingIOError):
                assert self.writer is not None
                self.writer.write(os.read(self.master, 65536))

        loop.add_reader(self.master, readable)

        async def down() -> None:
            while data := await reader.read(65536):
                os.write(self.master, data)

        self._pump = asyncio.create_task(down())

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.master)
        if self._pump is not None:
            self._pump.cancel()
        if self.writer is not None:
            self.writer.close()
        os.close(self.master)
        os.close(self.slave)


async def test_the_serial_bridge_carries_the_gateway_protocol_like_a_forward(
    gateway: tuple[LinkGateway, int, Upstream, Upstream],
) -> None:
    """The agent's bridge to the link's virtio-serial port (`agent/serial_link.py`): what the
    agent dials as its gateway when the machine has the port. The reset that waits in a new
    pipe is dropped by the sync through it, a CONNECT reaches the link listener, and the
    newest connection takes the pipe over (the one before it ends) as with the forward."""
    from agentic_sandbox.agent.channels import sync_forward
    from agentic_sandbox.agent.serial_link import SerialBridge

    gw, port, link, enroll = gateway
    chardev = PtyChardev()
    await chardev.connect(port)
    bridge = await SerialBridge.open(chardev.device)
    assert bridge is not None
    try:
        assert await sync_forward(bridge.address) is True
        assert gw.metrics_syncs == 1
        host, bport = bridge.address.split(":")
        first_r, first_w = await asyncio.open_connection(host, int(bport))
        first_w.write(ENROLL + b"csr")
        await _read_exactly(first_r, ESTABLISHED)  # not the reset: the sync took it
        await _read_exactly(first_r, b"enroll:csr")
        big = os.urandom(1 << 20)  # many pages and batches, in order
        first_w.write(big)
        await _until(lambda: len(enroll.received[0]) == len(big) + 3, "all of it upstream")
        assert bytes(enroll.received[0]) == b"csr" + big
        # the next connection (a sync, as the agent's next dial starts) takes the pipe over:
        # the one before it ends, and the echo still on its way is dropped by the sync
        assert await sync_forward(bridge.address) is True
        async with asyncio.timeout(5):
            while await first_r.read(65536):
                pass
        reader, writer = await asyncio.open_connection(host, int(bport))
        writer.write(LINK + b"register")
        await _read_exactly(reader, ESTABLISHED)
        await _read_exactly(reader, b"link:register")
        assert bytes(link.received[0]) == b"register"
        writer.close()
    finally:
        await bridge.aclose()
        chardev.close()


async def test_a_machine_without_the_port_has_no_serial_bridge(tmp_path: Path) -> None:
    from agentic_sandbox.agent.serial_link import SerialBridge

    assert await SerialBridge.open(str(tmp_path / "org.agentic-sandbox.link")) is None


async def test_the_newest_of_connections_made_at_once_has_the_serial_port() -> None:
    """Connections that arrive together (a reconnect racing a stale one): the last one has the
    port and the others end, as with the forward — none waits for an older one to hang up."""
    from agentic_sandbox.agent.serial_link import SerialBridge

    chardev = PtyChardev()  # not connected to a gateway: the test plays the host side
    master = chardev.master
    bridge = await SerialBridge.open(chardev.device)
    assert bridge is not None
    host, port = bridge.address.split(":")
    try:
        conns = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        for reader, _writer in conns[:-1]:  # the older ones end (nothing was sent to them)
            assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = conns[-1]
        os.write(master, b"to the newest")
        await _read_exactly(reader, b"to the newest")
        writer.write(b"from the newest")
        await writer.drain()
        got = b""
        async with asyncio.timeout(5):
            while len(got) < len(b"from the newest"):
                got += await asyncio.to_thread(os.read, master, 100)
        assert got == b"from the newest"
        for _reader, w in conns:
            w.close()
    finally:
        await bridge.aclose()
        chardev.close()


async def test_a_bridged_connection_ends_with_its_host_side_and_the_next_one_waits_for_one() -> (
    None
):
    """The port's host side goes away (the server stopped, QEMU's chardev lost its
    connection): the connection spliced to it ends at once, as a TCP connection through a
    forward would, so the agent's link fails then rather than when the next host connection's
    reset arrives. A connection made while there is no host side is held, its bytes unread,
    until one is there again. (A PTY has no host side to lose: the test says when it is away,
    where a real port polls as hung up.)"""
    from agentic_sandbox.agent.serial_link import SerialBridge

    class Port(SerialBridge):
        away = False

        def _host_away(self) -> bool:
            return self.away

    chardev = PtyChardev()
    master = chardev.master
    bridge = await Port.open(chardev.device)
    assert isinstance(bridge, Port)
    host, port = bridge.address.split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        os.write(master, b"before")
        await _read_exactly(reader, b"before")
        bridge.away = True
        os.write(master, b"last")  # what the host sent before it went is still delivered
        await _read_exactly(reader, b"last")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and then the connection ends
        writer.close()

        held_r, held_w = await asyncio.open_connection(host, int(port))
        held_w.write(b"CONNECT sync")
        await held_w.drain()
        os.set_blocking(master, False)
        await asyncio.sleep(0.3)  # several of the bridge's looks at the port
        with pytest.raises(BlockingIOError):
            os.read(master, 100)  # nothing went into a port with no host side
        bridge.away = False
        got = b""
        async with asyncio.timeout(5):
            while len(got) < len(b"CONNECT sync"):
                try:
                    got += os.read(master, 100)
                except BlockingIOError:
                    await asyncio.sleep(0.02)
        assert got == b"CONNECT sync"
        os.write(master, b"answer")
        await _read_exactly(held_r, b"answer")
        held_w.close()
    finally:
        await bridge.aclose()
        chardev.close()
