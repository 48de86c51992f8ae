"""One proxied connection: the HTTP request from the guest (h11), the decision, the upstream.

The guest's side is a `Pipe` (an egress stream on its agent link, or a socket in tests and
benchmarks). Its first request decides what happens:

- `CONNECT host:port` — checked, then answered `200` once the upstream TCP connection to the
  checked address is open, and from then on bytes pass through untouched both ways (TLS stays
  end to end: the proxy sees the name, never the content);
- `METHOD http://host[:port]/path` — checked (with the method), then sent upstream in origin
  form with the hop-by-hop headers removed and `Connection: close`, and the answer relayed
  back (h11 frames both sides: bodies are streamed, never buffered whole). One request per
  connection: the answer ends with `Connection: close`.

- `CONNECT host:port` to a destination with a **brokered credential** (`broker` answers a
  `Brokered` for it) — the upstream is connected and its TLS verified first (a certificate
  that does not verify is refused, 502 `upstream-certificate`, before the guest sees a `200`),
  then the guest's TLS is terminated with a leaf of the incarnation's CA (`ssl.MemoryBIO`
  over the pipe) and its one request is sent upstream (h11 both sides) with the credential's
  header set — replacing whatever the guest sent under that name — and `Connection: close`.
  Every other destination is a plain tunnel, never intercepted.

**Whose run.** The request's `Proxy-Authorization: Basic` (a proxy URL with userinfo,
`http://run:<token>@…`, which the agent gives each exec) names the run the connection is
counted to: the password of login `run` is `outcome.account`, read with aiohttp's
`BasicAuth` and never sent upstream (it is hop-by-hop). It is accounting only: no header, a
malformed one or an unknown token decides exactly as any other request (`on_request` is
told, once the head is read).

A refusal is an HTTP answer at once (403 denied, 429 over a limit, 502 the upstream could not be
reached, 400 a request that is not one), with the reason in `X-Egress-Reason` and a line of
text; never a hang. Bytes are counted as the guest sees them (read from and written to its
pipe), bandwidth taken from the instance's buckets in whole chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import h11
from aiohttp import BasicAuth

from agentic_sandbox.broker.egress.limits import InstanceLimits
from agentic_sandbox.broker.egress.policy import Decision, check, deny
from agentic_sandbox.broker.egress.resolver import Resolver
from agentic_sandbox.provision.egress_rules import EgressConfig

HEAD_TIMEOUT = 15.0  # the request head must arrive within this
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0  # a tunnel or relay with no byte either way for this long ends
MAX_HEAD = 16 * 1024
READ_CHUNK = 64 * 1024
RUN_LOGIN = "run"  # the proxy login whose password is a run's egress token
MAX_TRIES = 4  # addresses tried per connection (each within CONNECT_TIMEOUT)
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"upgrade",
    }
)


class Pipe(Protocol):
    """The guest's side of one connection."""

    async def read(self) -> bytes:
        """The next bytes from the guest; b"" once it half-closed (or went away)."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None:
        """Nothing more goes to the guest."""
        ...


@dataclass
class Outcome:
    """What happened, for the audit row, the event and the metrics."""

    verdict: str = "denied"  # allowed, denied, failed
    reason: str = ""
    detail: str = ""
    kind: str = ""  # connect, http
    method: str = ""
    host: str = ""
    port: int = 0
    address: str = ""
    status: int = 0
    credential: str = ""  # the secret's name, when its header was added (never the value)
    account: str = ""  # the run token of its Proxy-Authorization (`run:<token>`), if any
    bytes_up: int = 0  # guest → proxy
    bytes_down: int = 0  # proxy → guest
    started: float = field(default_factory=time.monotonic)
    duration: float = 0.0


class Counted:
    """The guest's pipe, counting bytes and taking them from the buckets."""

    def __init__(self, pipe: Pipe, outcome: Outcome, limits: InstanceLimits) -> None:
        self._pipe = pipe
        self._outcome = outcome
        self._limits = limits

    async def read(self) -> bytes:
        data = await self._pipe.read()
        if data:
            self._outcome.bytes_up += len(data)
            await self._limits.up.take(len(data))
        return data

    async def write(self, data: bytes) -> None:
        if not data:
            return
        await self._limits.down.take(len(data))
        self._outcome.bytes_down += len(data)
        await self._pipe.write(data)

    async def end(self) -> None:
        await self._pipe.end()


class BadRequest(Exception):
    pass


@dataclass(frozen=True)
class Brokered:
    """How one intercepted destination is served: the contexts and the header to set."""

    name: str  # the secret's name (for the record)
    header: bytes  # lower case
    value: bytes = field(repr=False)
    guest_context: ssl.SSLContext = field(repr=False)  # the leaf of the incarnation's CA
    upstream_context: ssl.SSLContext = field(repr=False)  # verifies the real server


class BrokerUnavailable(Exception):
    """A destination has a credential that cannot be used now (reason, detail)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class TlsPipe:
    """The guest's TLS, terminated here: `ssl.SSLObject` over memory BIOs on the guest's pipe."""

    def __init__(self, pipe: Pipe, context: ssl.SSLContext, early: bytes) -> None:
        self._pipe = pipe
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=True)
        if early:
            self._in.write(early)

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            await self._pipe.write(data)

    async def _fill(self) -> bool:
        data = await self._pipe.read()
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionError("the guest closed during the TLS handshake") from None
            except ssl.SSLError:
                with contextlib.suppress(Exception):
                    await self._flush()  # the alert, so the guest knows why
                raise
        await self._flush()

    async def read(self) -> bytes:
        while True:
            try:
                data = self._tls.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    return b""
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except ssl.SSLError as exc:
                raise ConnectionError(f"guest TLS: {exc}") from None
            await self._flush()
            return data

    async def write(self, data: bytes) -> None:
        if data:
            self._tls.write(data)
            await self._flush()

    async def end(self) -> None:
        with contextlib.suppress(ssl.SSLError, ValueError):
            self._tls.unwrap()
        with contextlib.suppress(Exception):
            await self._flush()
        await self._pipe.end()


Config = Callable[[], EgressConfig | None]
Broker = Callable[[str, int], Awaitable[Brokered | None]]
OnRequest = Callable[["Outcome"], None]
Opener = Callable[[str, int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def open_tcp(address: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(CONNECT_TIMEOUT):
        return await asyncio.open_connection(address, port, limit=READ_CHUNK)


class ProxyConnection:
    """Serves one guest connection (`run`), filling `outcome`."""

    def __init__(
        self,
        pipe: Pipe,
        *,
        config: Config,
        resolver: Resolver,
        limits: InstanceLimits,
        opener: Opener = open_tcp,
        broker: Broker | None = None,
        on_request: OnRequest | None = None,
    ) -> None:
        self.outcome = Outcome()
        self._on_request = on_request
        self._pipe = Counted(pipe, self.outcome, limits)
        self._config = config
        self._resolver = resolver
        self._limits = limits
        self._open = opener
        self._broker = broker
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)

    async def run(self) -> Outcome:
        try:
            await self._serve()
        finally:
            self.outcome.duration = time.monotonic() - self.outcome.started
            with contextlib.suppress(Exception):
                await self._pipe.end()
        return self.outcome

    # ---- the request ------------------------------------------------------------------------
    async def _next_event(
        self, conn: h11.Connection, source: Callable[[], Awaitable[bytes]]
    ) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await source())

    async def _serve(self) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                request = await self._next_event(self._h11, self._pipe.read)
        except TimeoutError:
            self.outcome.reason, self.outcome.detail = "bad-request", "no request in time"
            return await self._refuse(408, "bad-request", "no request head in time")
        except h11.RemoteProtocolError as exc:
            self.outcome.reason = "bad-request"
            return await self._refuse(400, "bad-request", f"not an HTTP request: {exc}")
        if not isinstance(request, h11.Request):
            self.outcome.reason = "bad-request"
            return  # the guest closed before a request: nothing to answer
        method = request.method.decode("ascii", "replace").upper()
        self.outcome.method = method
        self.outcome.account = _account(request.headers)
        if self._on_request is not None:
            self._on_request(self.outcome)
        try:
            host, port, path = _target(method, request.target.decode("ascii", "replace"))
        except BadRequest as exc:
            return await self._refuse(400, "bad-request", str(exc))
        self.outcome.kind = "connect" if method == "CONNECT" else "http"
        self.outcome.host, self.outcome.port = host, port
        config = self._config()
        if config is None:
            decision = deny(host, "no-policy", "this instance has no egress allowlist")
        else:
            decision = await check(
                config, host, port, None if method == "CONNECT" else method, self._resolver
            )
        self.outcome.host = decision.host
        self.outcome.address = decision.address
        if not decision.allowed:
            return await self._refuse(403, decision.reason, decision.detail)
        if not self._limits.try_acquire():
            return await self._refuse(
                429,
                "connection-limit",
                f"this instance has {self._limits.active} egress connections open "
                f"(the limit is {self._limits.max_connections})",
            )
        try:
            brokered: Brokered | None = None
            if method == "CONNECT" and self._broker is not None:
                try:
                    brokered = await self._broker(decision.host, port)
                except BrokerUnavailable as exc:
                    return await self._refuse(502, exc.reason, exc.detail, verdict="failed")
            upstream = await self._connect(decision)
            if upstream is None:
                return None
            if brokered is not None:
                await self._intercept(brokered, decision, port, *upstream)
            elif method == "CONNECT":
                await self._tunnel(*upstream)
            else:
                await self._forward(request, method, decision, port, path, *upstream)
        finally:
            self._limits.release()
        return None

    async def _connect(
        self, decision: Decision
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        last = ""
        for address in decision.addresses[:MAX_TRIES]:
            try:
                pair = await self._open(str(address), self.outcome.port)
            except (OSError, TimeoutError) as exc:
                last = f"{address}: {getattr(exc, 'strerror', None) or exc or 'timed out'}"
                continue
            self.outcome.address = str(address)
            return pair
        self.outcome.verdict = "failed"
        await self._refuse(502, "upstream-unreachable", f"cannot connect: {last}", verdict="failed")
        return None

    async def _refuse(
        self,
        status: int,
        reason: str,
        detail: str,
        *,
        verdict: str = "denied",
        side: tuple[h11.Connection, Pipe] | None = None,
    ) -> None:
        conn, pipe = side or (self._h11, self._pipe)
        out = self.outcome
        out.verdict, out.reason, out.detail, out.status = verdict, reason, detail, status
        body = f"egress {verdict}: {reason}: {detail}\n".encode("utf-8", "replace")
        headers = [
            ("content-type", "text/plain; charset=utf-8"),
            ("content-length", str(len(body))),
            ("connection", "close"),
            ("x-egress-reason", reason),
        ]
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # an answer is under way already
        try:
            await self._send(conn, h11.Response(status_code=status, headers=headers), pipe)
            await self._send(conn, h11.Data(data=body), pipe)
            await self._send(conn, h11.EndOfMessage(), pipe)
        except (h11.LocalProtocolError, ConnectionError, ssl.SSLError):
            pass

    async def _send(self, conn: h11.Connection, event: h11.Event, pipe: Pipe | None = None) -> None:
        data = conn.send(event)
        if data:
            await (pipe or self._pipe).write(data)

    # ---- CONNECT ------------------------------------------------------------------------------
    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        out = self.outcome
        out.verdict, out.status = "allowed", 200
        await self._send(
            self._h11, h11.Response(status_code=200, headers=[], reason=b"Connection established")
        )
        early, _closed = self._h11.trailing_data
        try:
            if early:
                writer.write(early)
            await _relay(self._pipe, reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    # ---- CONNECT to a destination with a brokered credential ------------------------------------
    async def _intercept(
        self,
        brokered: Brokered,
        decision: Decision,
        port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        out = self.outcome
        try:
            try:
                await writer.start_tls(
                    brokered.upstream_context,
                    server_hostname=decision.host,
                    ssl_handshake_timeout=CONNECT_TIMEOUT,
                )
            except ssl.SSLCertVerificationError as exc:
                why = exc.verify_message or str(exc)
                return await self._refuse(
                    502,
                    "upstream-certificate",
                    f"{decision.host}:{port} has a certificate that does not verify: {why}",
                    verdict="failed",
                )
            except (ssl.SSLError, ConnectionError, OSError, TimeoutError) as exc:
                return await self._refuse(
                    502,
                    "upstream-tls-failed",
                    f"TLS with {decision.host}:{port}: {type(exc).__name__}: {exc}",
                    verdict="failed",
                )
            out.verdict, out.status = "failed", 200
            await self._send(
                self._h11,
                h11.Response(status_code=200, headers=[], reason=b"Connection established"),
            )
            early, _closed = self._h11.trailing_data
            tls = TlsPipe(self._pipe, brokered.guest_context, early)
            try:
                async with asyncio.timeout(HEAD_TIMEOUT):
                    await tls.handshake()
            except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
                out.reason = "guest-tls-failed"
                out.detail = f"the guest's TLS did not complete: {type(exc).__name__}: {exc}"
                return None
            try:
                await self._inside(brokered, decision, port, tls, reader, writer)
            finally:
                with contextlib.suppress(Exception):
                    await tls.end()  # close_notify, then the pipe's end
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _inside(
        self,
        brokered: Brokered,
        decision: Decision,
        port: int,
        tls: TlsPipe,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """The one request inside an intercepted tunnel, with the credential's header."""
        out = self.outcome
        inner = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        try:
            async with asyncio.timeout(IDLE_TIMEOUT):
                request = await self._next_event(inner, tls.read)
        except (h11.RemoteProtocolError, ConnectionError, TimeoutError) as exc:
            out.reason = "bad-request"
            out.detail = f"no HTTP request inside the tunnel: {type(exc).__name__}: {exc}"
            return await self._refuse(
                400, "bad-request", out.detail, verdict="failed", side=(inner, tls)
            )
        if not isinstance(request, h11.Request):
            out.reason, out.detail = "bad-request", "the guest closed without a request"
            return None
        method = request.method.decode("ascii", "replace").upper()
        target = request.target.decode("ascii", "replace")
        out.method = method
        if not target.startswith("/"):
            return await self._refuse(
                400,
                "bad-request",
                f"inside a tunnel a request names a path, not {target[:120]!r}",
                side=(inner, tls),
            )
        await self._forward(
            request,
            method,
            decision,
            port,
            target,
            reader,
            writer,
            side=(inner, tls),
            inject=brokered,
        )

    # ---- plain HTTP ---------------------------------------------------------------------------
    async def _forward(
        self,
        request: h11.Request,
        method: str,
        decision: Decision,
        port: int,
        path: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        side: tuple[h11.Connection, Pipe] | None = None,
        inject: Brokered | None = None,
    ) -> None:
        """One request from the guest (`side`: its h11 connection and pipe; the proxy request
        by default, the one inside an intercepted tunnel otherwise) sent upstream and its
        answer relayed; `inject`: the header set on the way (replacing the guest's)."""
        out = self.outcome
        guest, pipe = side or (self._h11, self._pipe)
        up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        default_port = 443 if inject is not None else 80
        host_header = decision.host if port == default_port else f"{decision.host}:{port}"
        if ":" in decision.host:
            host_header = f"[{decision.host}]:{port}"
        drop = {b"host"} | ({inject.header} if inject is not None else set())
        headers = [(b"host", host_header.encode())]
        headers += [(k, v) for k, v in _end_to_end(request.headers) if k.lower() not in drop]
        if inject is not None:
            headers.append((inject.header, inject.value))
        headers.append((b"connection", b"close"))

        async def to_upstream(data: bytes) -> None:
            if data:
                writer.write(data)
                await writer.drain()

        async def from_upstream() -> bytes:
            async with asyncio.timeout(IDLE_TIMEOUT):
                return await reader.read(READ_CHUNK)

        try:
            try:
                head = up.send(h11.Request(method=method, target=path, headers=headers))
            except h11.LocalProtocolError:
                if inject is None:
                    raise
                # the secret's value is not a header value (a line break, a control byte)
                await self._refuse(
                    502,
                    "credential-unusable",
                    f"the value of secret {inject.name!r} cannot be sent as a header",
                    verdict="failed",
                    side=side,
                )
                return
            await to_upstream(head)
            if inject is not None:
                out.credential = inject.name
            while True:  # the request body, as it comes
                async with asyncio.timeout(IDLE_TIMEOUT):
                    event = await self._next_event(guest, pipe.read)
                if isinstance(event, h11.Data):
                    await to_upstream(up.send(h11.Data(data=event.data)))
                elif isinstance(event, h11.EndOfMessage):
                    await to_upstream(up.send(h11.EndOfMessage()))
                    break
                else:
                    raise h11.RemoteProtocolError("the request ended early")
            response = await self._next_event(up, from_upstream)
            while isinstance(response, h11.InformationalResponse):
                response = await self._next_event(up, from_upstream)
            if not isinstance(response, h11.Response):
                raise h11.RemoteProtocolError("the upstream closed without an answer")
            out.verdict, out.status = "allowed", response.status_code
            resp_headers = [*_end_to_end(response.headers), (b"connection", b"close")]
            await self._send(
                guest,
                h11.Response(
                    status_code=response.status_code, headers=resp_headers, reason=response.reason
                ),
                pipe,
            )
            while True:
                event = await self._next_event(up, from_upstream)
                if isinstance(event, h11.Data):
                    await self._send(guest, h11.Data(data=event.data), pipe)
                elif isinstance(event, h11.EndOfMessage):
                    await self._send(guest, h11.EndOfMessage(), pipe)
                    break
                else:
                    raise h11.RemoteProtocolError("the upstream answer ended early")
        except (h11.ProtocolError, ConnectionError, TimeoutError, ssl.SSLError) as exc:
            if out.verdict != "allowed":
                await self._refuse(
                    502,
                    "upstream-failed",
                    f"{type(exc).__name__}: {exc}",
                    verdict="failed",
                    side=side,
                )
            else:
                out.detail = f"ended early: {type(exc).__name__}: {exc}"
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _account(headers: Sequence[tuple[bytes, bytes]]) -> str:
    """The run token of the request's `Proxy-Authorization: Basic run:<token>` ("" without
    a usable one)."""
    for key, value in headers:
        if key.lower() == b"proxy-authorization":
            try:
                auth = BasicAuth.decode(value.decode("latin-1"))
            except ValueError:
                return ""
            token = auth.password
            if auth.login != RUN_LOGIN or not (token.isascii() and token.isprintable()):
                return ""
            return token[:80]
    return ""


def _end_to_end(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers without the hop-by-hop ones (and those the `Connection` header names)."""
    named = {
        t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")
    }
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


def _target(method: str, target: str) -> tuple[str, int, str]:
    """(host, port, origin-form path) of a proxy request's target."""
    if method == "CONNECT":
        parts = urlsplit("//" + target)
        if parts.path or parts.query or not parts.hostname:
            raise BadRequest(f"CONNECT wants host:port, not {target[:120]!r}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if port is None:
            raise BadRequest(f"CONNECT wants host:port, not {target[:120]!r}")
        return parts.hostname, port, ""
    parts = urlsplit(target)
    if parts.scheme.lower() != "http" or not parts.hostname:
        if parts.scheme.lower() == "https":
            raise BadRequest("an https:// URL goes through CONNECT")
        raise BadRequest(f"a proxy request wants an absolute http:// URL, not {target[:120]!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise BadRequest(f"a bad port in {target[:120]!r}") from None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, port, path


async def _relay(pipe: Counted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes both ways until both sides have ended (or one fails, or nothing moves)."""
    moved = asyncio.Event()

    async def up() -> None:
        while True:
            data = await pipe.read()
            moved.set()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    async def down() -> None:
        while True:
            data = await reader.read(READ_CHUNK)
            moved.set()
            if not data:
                await pipe.end()
                return
            await pipe.write(data)

    tasks = {asyncio.ensure_future(up()), asyncio.ensure_future(down())}
    try:
        pending = set(tasks)
        while pending:
            moved.clear()
            watcher = asyncio.ensure_future(moved.wait())
            done, _ = await asyncio.wait(
                pending | {watcher}, timeout=IDLE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
            watcher.cancel()
            if not done:
                return  # idle: both sides are cut
            for task in done - {watcher}:
                pending.discard(task)
                if task.exception() is not None:
                    return  # a side failed: the other is cut
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SocketPipe:
    """A TCP connection as the guest's `Pipe` (tests, benchmarks, development)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self) -> bytes:
        try:
            return await self._reader.read(READ_CHUNK)
        except ConnectionError:
            return b""

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def end(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()
