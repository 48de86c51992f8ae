"""The guest end of the egress proxy: a listener on the guest's loopback for its tools.

In an `allowlist` guest the seed points `http_proxy`/`https_proxy` (and apt, pip, npm, git) at
`egress_listen` (127.0.0.1:3128). Each connection a tool makes there becomes one stream of kind
`egress` on the agent link, and its bytes go as they are to the server's egress proxy, which
reads the HTTP request, decides, and answers (a refusal, a `CONNECT` tunnel, or the relayed
answer). Nothing is decided here: the guest has no route and no DNS, and the proxy on the host
knows the instance from the link itself. Flow control is the stream's credit: the socket stops
being read when the server has granted nothing more, and credit goes back only as the socket
takes what the server sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from agentic_sandbox.agent.streams import CHUNK, Stream, StreamRefused, StreamTable
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"x-egress-reason: link-down\r\ncontent-length: 37\r\n\r\n"
    b"egress failed: the agent link is down\n"
)


TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def proxy_env(listen: str, token: str = "") -> dict[str, str]:
    """The proxy variables for the agent's sessions and execs (both spellings).

    `token`: the run's egress token from the server (an exec's): the proxy URL carries it as
    its userinfo (`http://run:<token>@listen`), which curl, pip, git, npm and Python's urllib
    send as `Proxy-Authorization: Basic` with every proxy request (urllib only with a password:
    the token is one), and the server's proxy counts the
    connection to that run. The settings pip, npm and git would otherwise take from the seed's
    files (which carry no token) are given too, as the environment overrides each tool reads.
    Accounting only: the proxy decides the same with or without it.
    """
    url = f"http://run:{token}@{listen}" if token else f"http://{listen}"
    env = {"http_proxy": url, "https_proxy": url, "no_proxy": "localhost,127.0.0.1,::1"}
    env = {**env, **{k.upper(): v for k, v in env.items()}}
    if token:
        env |= {
            "PIP_PROXY": url,
            "npm_config_proxy": url,
            "npm_config_https_proxy": url,
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "http.proxy",
            "GIT_CONFIG_VALUE_0": url,
        }
    return env


class EgressConnection(asyncio.Protocol):
    """One tool's connection, relayed over one egress stream."""

    def __init__(self, streams: StreamTable, connected: Callable[[], bool]) -> None:
        self._streams = streams
        self._connected = connected
        self._transport: asyncio.Transport | None = None
        self._stream: Stream | None = None
        self._pending = bytearray()  # read from the socket, not yet sent (no credit)
        self._eof_pending = False  # the tool half-closed; send it after the pending bytes
        self._owed = 0  # received from the server, credited once the socket takes it
        self._write_paused = False
        self._done = False

    # ---- the socket -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._connected():
            transport.write(UNAVAILABLE)
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        try:
            self._stream = self._streams.open(
                pb.StreamOpen(egress=pb.EgressSpec(client=client)), self
            )
        except StreamRefused:
            transport.write(UNAVAILABLE.replace(b"link-down", b"too-many-stre"))
            transport.close()
            return
        transport.pause_reading()  # until the accept's window arrives

    def data_received(self, data: bytes) -> None:
        self._pending += data
        self._flush()

    def eof_received(self) -> bool:
        self._eof_pending = True
        self._flush()
        return True  # keep the socket open for the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        stream = self._stream
        if stream is not None and not self._done:
            self._done = True
            stream.finish(pb.StreamClose())

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._stream is not None and self._owed:
            self._stream.consumed(0, self._owed)
            self._owed = 0

    def _flush(self) -> None:
        stream, transport = self._stream, self._transport
        if stream is None or transport is None or not stream.accepted or self._done:
            return
        while self._pending:
            n = min(stream.room(0), CHUNK, len(self._pending))
            if n <= 0:
                break
            stream.send(0, bytes(self._pending[:n]))
            del self._pending[:n]
        if self._pending:
            transport.pause_reading()
            return
        if self._eof_pending:
            self._eof_pending = False
            stream.send(0, b"", eof=True)
            return
        transport.resume_reading()

    # ---- the stream (StreamHandler) ---------------------------------------------------------
    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        transport, stream = self._transport, self._stream
        if channel != 0 or stream is None:
            return
        if transport is None:
            stream.consumed(0, len(data))
            return
        if data:
            transport.write(data)
            if self._write_paused:
                self._owed += len(data)
            else:
                stream.consumed(0, len(data))
        if eof:
            try:
                if transport.can_write_eof():
                    transport.write_eof()
            except OSError:  # the tool is gone already (its side is shut down)
                transport.close()

    def on_credit(self, channel: int) -> None:
        if channel == 0:
            self._flush()

    def on_close(self, error: pb.StreamError | None) -> None:
        if error is not None and error.code not in ("", "canceled"):
            log.info("egress stream ended: %s %s", error.code, error.message)
        if self._stream is not None and not self._done:
            self._done = True
            self._stream.finish(pb.StreamClose())
        if self._transport is not None:
            self._transport.close()  # after what was written (close flushes)


async def serve(listen: str, streams: StreamTable, connected: Callable[[], bool]) -> asyncio.Server:
    """Start the listener on `listen` (HOST:PORT)."""
    host, _, port = listen.rpartition(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: EgressConnection(streams, connected), host.strip("[]"), int(port)
    )
    log.info("egress proxy listener on %s", listen)
    return server
