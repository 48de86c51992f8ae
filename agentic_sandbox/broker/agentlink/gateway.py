"""The guests' way in: one listener that every guest's agent reaches through its guest forward.

A guest reaches the control plane through a QEMU user-network forward (`guestfwd`) whose host
side is one TCP connection per guest, made by QEMU and kept across everything that happens in
the guest. That pipe has no connection boundaries: a guest that closes its connection and opens
another (an agent restart, a reconnect, a restored clone whose old connection leads nowhere)
continues on the same host connection, and after a server restart or a memory restore the host
connection is new while the guest's is not. Stitching gRPC's TLS streams through it as they come
is what made links fail with handshake errors and 15 s deadlines.

So every guest connection starts with an HTTP `CONNECT` request (gRPC's own HTTP proxy support:
the agent dials `link.agentic-sandbox.invalid` or `enroll.agentic-sandbox.invalid` through this
listener as its proxy). The gateway treats each `CONNECT` as the start of a new guest
connection — wherever it appears in the pipe — and gives it a fresh upstream connection to the
gRPC listener the name asks for; whatever came before it (a stale connection's bytes) is
dropped. When QEMU (re)connects a pipe, the gateway first sends an HTTP 503 down it (`RESET`),
so a guest connection that was open across a restore or a server restart — mid-TLS or still
waiting for its CONNECT's answer — fails at once instead of waiting for a timeout.

What the host sends down a pipe while the guest has no connection open waits for the guest's
next one (QEMU reads the pipe only into a guest connection): a `RESET` sent to a member of a
warm pool restored paused, or a reply to a connection the guest already closed, is the first
thing its next connection reads. So before each connection the agent *syncs* the pipe: a
`CONNECT sync.agentic-sandbox.invalid` carrying a nonce (`SYNC_HEADER`), which the gateway
answers at once, without an upstream, echoing the nonce; the agent reads and drops everything
up to that answer, and its next connection starts clean (`agent/channels.py`).

Bytes pass through once in each direction (an asyncio protocol pair, flow-controlled both
ways); the only per-chunk work on the hot path is one `bytes.find` for the next `CONNECT`.
The pipe is exclusive to the agent: the seed's guest firewall lets only root open the forward.

A guest's virtio-serial port for the link (`org.agentic-sandbox.link`, the fleet's domain XML)
is a pipe of the same kind, made by QEMU the same way: the gateway cannot tell them apart and
need not. The agent prefers the port (`agent/serial_link.py`) and bridges it so that it behaves
as the forward does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import cast

import h11

from agentic_sandbox.proto import SYNC_HEADER

log = logging.getLogger(__name__)

MARKER = b"CONNECT "
NAME_SUFFIX = b".agentic-sandbox.invalid"
SERVICES = ("link", "enroll", "sync")
SYNC_NONCE_MAX = 64
#: What a (re)made pipe sends first, and what a guest connection gets when its upstream ends:
#: a complete HTTP error response. It ends whatever guest connection was left in the pipe — a
#: pending CONNECT reads a 503 (an HTTP parser waits for a line end, so a bare TLS alert would
#: leave it hanging), an established TLS stream reads a record of no valid type and fails.
RESET = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
MAX_REQUEST = 8 * 1024  # a CONNECT request with its headers
MAX_PENDING = 256 * 1024  # guest bytes held while the upstream connects
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


@dataclass(frozen=True)
class Upstreams:
    """Where each service name leads (the server's own gRPC listeners)."""

    link: tuple[str, int]
    enroll: tuple[str, int]

    def of(self, service: str) -> tuple[str, int]:
        return self.link if service == "link" else self.enroll


@dataclass(frozen=True)
class ConnectRequest:
    service: str  # one of SERVICES
    nonce: bytes = b""  # a sync request's SYNC_HEADER


def parse_connect(request: bytes) -> ConnectRequest | None:
    """The service a complete CONNECT request asks for (`link`/`enroll`/`sync`), else None."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Request) or event.method != b"CONNECT":
        return None
    host = event.target.rpartition(b":")[0]
    if not host.endswith(NAME_SUFFIX):
        return None
    service = host[: -len(NAME_SUFFIX)].decode("ascii", "replace")
    if service not in SERVICES:
        return None
    nonce = b""
    if service == "sync":
        nonce = next((v for k, v in event.headers if k == SYNC_HEADER), b"")
        if not nonce or len(nonce) > SYNC_NONCE_MAX or not nonce.isalnum():
            return None
    return ConnectRequest(service, nonce)


def sync_answer(nonce: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + SYNC_HEADER + b": " + nonce + b"\r\ncontent-length: 0\r\n\r\n"


class _Upstream(asyncio.Protocol):
    """The gateway's connection to a gRPC listener, for one guest connection."""

    def __init__(self, pipe: GuestPipe) -> None:
        self.pipe = pipe
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self.pipe.from_upstream(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe.upstream_lost(self)

    def pause_writing(self) -> None:
        self.pipe.pause_guest(self)

    def resume_writing(self) -> None:
        self.pipe.resume_guest(self)


class GuestPipe(asyncio.Protocol):
    """One host-side connection of a guest forward (or one direct guest connection)."""

    def __init__(self, gateway: LinkGateway) -> None:
        self.gateway = gateway
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        self.splicing = False
        self.buf = bytearray()  # guest bytes not yet passed on (scanning or connecting)
        self.tail = b""  # the last bytes passed on, to find a CONNECT split across chunks
        self.peer = ""

    # ---- the guest side -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.peer = str(transport.get_extra_info("peername"))
        self.gateway.pipes.add(self)
        self.transport.write(RESET)  # whatever guest connection was open through it ends now

    def connection_lost(self, exc: Exception | None) -> None:
        self.gateway.pipes.discard(self)
        self._drop_upstream()

    def data_received(self, data: bytes) -> None:
        if self.splicing:
            window = self.tail + data
            at = window.find(MARKER)
            if at < 0:
                up = self.upstream.transport if self.upstream is not None else None
                if up is not None:
                    up.write(data)
                self.tail = window[-(len(MARKER) - 1) :]
                return
            # The guest opened a new connection: the current one is over.
            before = at - len(self.tail)
            if before > 0 and self.upstream is not None and self.upstream.transport is not None:
                self.upstream.transport.write(data[:before])
            self.gateway.metrics_restarts += 1
            self._drop_upstream()
            self.buf = bytearray(window[at:])
        else:
            self.buf += data
        self._scan()

    def pause_writing(self) -> None:  # the guest side is full: stop reading the upstream
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # ---- the upstream side ----------------------------------------------------------------
    def from_upstream(self, up: _Upstream, data: bytes) -> None:
        if up is self.upstream and self.splicing and self.transport is not None:
            self.transport.write(data)

    def upstream_lost(self, up: _Upstream) -> None:
        if up is not self.upstream:
            return
        self.upstream = None
        self.splicing = False
        if self.transport is not None and not self.transport.is_closing():
            # The server ended the connection: the guest's TLS connection must end too (its
            # pipe cannot be closed without ending the forward itself).
            self.transport.write(RESET)

    def pause_guest(self, up: _Upstream) -> None:
        if up is self.upstream and self.transport is not None:
            self.transport.pause_reading()

    def resume_guest(self, up: _Upstream) -> None:
        if up is self.upstream and self.transport is not None:
            self.transport.resume_reading()

    # ---- connection starts -----------------------------------------------------------------
    def _scan(self) -> None:
        if self.upstream is not None:  # connecting: hold what comes (bounded)
            if len(self.buf) > MAX_PENDING and self.transport is not None:
                self.transport.pause_reading()
            return
        at = self.buf.find(MARKER)
        if at < 0:
            keep = len(MARKER) - 1  # stale bytes: dropped, but a CONNECT may be starting
            if len(self.buf) > keep:
                del self.buf[:-keep]
            return
        if at:
            del self.buf[:at]
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_REQUEST:
                del self.buf[: len(MARKER)]  # not a request after all: look further
                self._scan()
            return
        request, rest = bytes(self.buf[: end + 4]), self.buf[end + 4 :]
        self.buf = bytearray(rest)
        req = parse_connect(request)
        if req is None:
            self.gateway.metrics_refused += 1
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
            self._scan()
            return
        if req.service == "sync":  # everything before this answer is the guest's to drop
            self.gateway.metrics_syncs += 1
            if self.transport is not None:
                self.transport.write(sync_answer(req.nonce))
            self._scan()
            return
        self._open(req.service)

    def _open(self, service: str) -> None:
        up = _Upstream(self)
        self.upstream = up
        host, port = self.gateway.upstreams.of(service)
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_connection(lambda: up, host, port))
        task.add_done_callback(lambda t: self._opened(up, t))

    def _opened(
        self, up: _Upstream, task: asyncio.Task[tuple[asyncio.Transport, _Upstream]]
    ) -> None:
        if task.cancelled() or task.exception() is not None:
            if up is self.upstream:
                self.upstream = None
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.write(
                        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
                    )
            return
        if up is not self.upstream or self.transport is None or self.transport.is_closing():
            if up.transport is not None:
                up.transport.close()
            return
        self.transport.write(ESTABLISHED)
        self.splicing = True
        self.tail = b""
        self.gateway.metrics_connections += 1
        pending, self.buf = bytes(self.buf), bytearray()
        self.transport.resume_reading()
        if pending:
            self.data_received(pending)

    def _drop_upstream(self) -> None:
        up, self.upstream = self.upstream, None
        self.splicing = False
        self.tail = b""
        if up is not None and up.transport is not None:
            up.transport.close()

    def close(self) -> None:
        self._drop_upstream()
        if self.transport is not None:
            self.transport.close()


class GatewayBindError(OSError):
    def __init__(self, host: str, port: int, cause: OSError) -> None:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        super().__init__(cause.errno, f"cannot listen on {where}: {cause.strerror or cause}")
        self.host = host


class LinkGateway:
    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams
        self.pipes: set[GuestPipe] = set()
        self._servers: list[asyncio.Server] = []
        self.metrics_connections = 0  # guest connections passed on
        self.metrics_restarts = 0  # new connections found mid-pipe
        self.metrics_refused = 0
        self.metrics_syncs = 0  # pipes a guest agent synced before a connection

    async def start(self, hosts: list[str], port: int) -> int:
        """Listen on every one of ``hosts`` at one port (``port``, or the first one bound when
        0). `GatewayBindError` names the address that could not be bound; nothing stays open."""
        loop = asyncio.get_running_loop()
        try:
            for host in hosts:
                try:
                    server = await loop.create_server(
                        lambda: GuestPipe(self), host, port, reuse_address=True
                    )
                except OSError as exc:
                    raise GatewayBindError(host, port, exc) from exc
                self._servers.append(server)
                port = server.sockets[0].getsockname()[1]
                log.info("guest link gateway listening", extra={"listen": f"{host}:{port}"})
        except BaseException:
            await self.stop()
            raise
        return port

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Where it listens (address, port) — one entry per socket."""
        return [s.getsockname()[:2] for srv in self._servers for s in srv.sockets]

    async def stop(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        for pipe in list(self.pipes):
            pipe.close()
        for server in servers:
            await server.wait_closed()
