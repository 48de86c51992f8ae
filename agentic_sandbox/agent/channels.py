"""gRPC channels to the server: the link (mutual TLS) and enrollment (server TLS).

A host agent dials a control host's listeners directly (the `ControlAddress` it dials now,
`controls.py`). A guest's
agent reaches the control plane through its guest forward, whose host side is the server's
guest link gateway: it dials the names `link.agentic-sandbox.invalid` and
`enroll.agentic-sandbox.invalid` with the gateway as its HTTP CONNECT proxy (gRPC's own proxy
support), so every connection it makes starts with a request the gateway can tell apart from
whatever was in the pipe before. Environment proxies (`http_proxy`, set in `allowlist` guests
for tools) never apply to the link.

Before each such connection the agent syncs the pipe (`sync_forward`): what the host sent while
the guest had no connection open (the gateway's reset of a re-made pipe — a warm-pool member is
restored paused, so it gets one before its agent ever connects — or the end of a connection the
agent already left) would otherwise be the first bytes the next connection reads, and fail its
proxy handshake. One short request and answer through the gateway, with no upstream.

When the guest's machine has the link's virtio-serial port, the agent's bridge to it
(`serial_link.py`, a loopback listener that behaves as the forward does) is dialed instead of the
forward (`AgentConfig.route`); everything above is the same through it.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Literal

import grpc

from agentic_sandbox.agent.config import AgentConfig
from agentic_sandbox.agent.controls import ControlAddress
from agentic_sandbox.agent.credentials import Credentials
from agentic_sandbox.proto import SYNC_HEADER, SYNC_HOST

Service = Literal["link", "enroll"]
GATEWAY_NAMES: dict[Service, str] = {
    "link": "link.agentic-sandbox.invalid:443",
    "enroll": "enroll.agentic-sandbox.invalid:443",
}
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    # One connection per channel, never a second one behind the agent's back: a guest's forward
    # carries one connection at a time, so gRPC must not reconnect on its own (an RPC fails at
    # the first failed attempt; the agent's loop makes a new channel). Each channel has
    # subchannels of its own, so a new channel never inherits an old one's backoff.
    ("grpc.initial_reconnect_backoff_ms", 120_000),
    ("grpc.min_reconnect_backoff_ms", 120_000),
    ("grpc.max_reconnect_backoff_ms", 120_000),
    ("grpc.use_local_subchannel_pool", 1),
]


def target_and_options(
    cfg: AgentConfig, service: Service, control: ControlAddress
) -> tuple[str, list[tuple[str, Any]]]:
    options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", cfg.server_name)]
    if cfg.route:
        options.append(("grpc.http_proxy", f"http://{cfg.route}"))
        return GATEWAY_NAMES[service], options
    options.append(("grpc.enable_http_proxy", 0))
    return (control.link if service == "link" else control.enroll), options


def open_channel(
    cfg: AgentConfig, creds: Credentials, service: Service, control: ControlAddress
) -> grpc.aio.Channel:
    target, options = target_and_options(cfg, service, control)
    return grpc.aio.secure_channel(
        target, creds.channel_credentials(client_cert=service == "link"), options=options
    )


async def connect_channel(
    cfg: AgentConfig, creds: Credentials, service: Service, control: ControlAddress
) -> grpc.aio.Channel:
    """`open_channel`, after syncing the guest forward when there is one (see the module).
    Raises `GatewaySilent` when no gateway answered the sync."""
    channel = open_channel(cfg, creds, service, control)  # a missing CA is named before
    if cfg.route:
        try:
            await sync_forward(cfg.route)
        except BaseException:
            await channel.close()
            raise
    return channel


SYNC_TIMEOUT = 5.0
SYNC_LIMIT = 256 * 1024  # stale bytes dropped at most before the answer


class GatewaySilent(ConnectionError):
    """No gateway answered the sync: there is none at the other end of the forward (or the
    port) now — the server is away. A connection made anyway would read the reset of the
    next pipe and fail; the agent tries again (sync first) after its short backoff."""


async def sync_forward(gateway: str) -> bool:
    """Drop whatever waits in the guest forward (`HOST:PORT` of the gateway) for the next
    connection: ask the gateway for a sync and read up to its answer, which echoes a fresh
    nonce. False when an older gateway refused the name (a 403: the connection that follows
    is then made as before); `GatewaySilent` when nothing answered at all."""
    host, _, port = gateway.rpartition(":")
    nonce = secrets.token_hex(8).encode()
    marker = b"\r\n" + SYNC_HEADER + b": " + nonce + b"\r\n"
    writer: asyncio.StreamWriter | None = None
    why = f"no answer in {SYNC_LIMIT} bytes"
    try:
        async with asyncio.timeout(SYNC_TIMEOUT):
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.write(
                b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s: %s\r\n\r\n"
                % (SYNC_HOST, SYNC_HOST, SYNC_HEADER, nonce)
            )
            seen = bytearray()
            while len(seen) < SYNC_LIMIT:
                data = await reader.read(65536)
                if not data:
                    why = "closed before its answer"
                    break
                seen += data
                at = seen.find(marker)
                if at >= 0 and seen.find(b"\r\n\r\n", at) >= 0:
                    return True
                if at < 0 and b"HTTP/1.1 403 " in seen:  # an older gateway: no sync there
                    return False
    except TimeoutError:
        why = f"no answer in {SYNC_TIMEOUT:g}s"
    except (OSError, ValueError) as exc:
        why = str(exc)
    finally:
        if writer is not None:
            writer.close()
    raise GatewaySilent(f"the gateway at {gateway}: {why}")
