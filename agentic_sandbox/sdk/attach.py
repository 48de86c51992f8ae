"""A session's terminal over the attach WebSocket (`sandbox.pty.v1`), as an async iterator.

    async with client.sessions.attach(session_id, from_offset=0) as term:
        await term.send(b"make test\\r")
        async for offset, data in term:     # until the session exits
            ...
    term.exit                               # SessionExit(code, signal, reason, lost)

Output arrives as `Output(offset, data)`: the offset of the first byte in the session's byte
stream. When the connection drops, the iterator reattaches with `from=<next offset>` and goes
on: nothing is lost or repeated, as long as the server still holds that offset (its ring keeps
the last few MiB). When it does not — or when this client fell too far behind — the server
skips ahead and sends a screen snapshot instead: the attachment records a `Resync` in
`resyncs` (and the next output's offset jumps) rather than pretending the stream is whole.

The iterator is the reader: keep iterating (in a task of its own if you also send) so control
messages are seen and a dropped connection is re-made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from agentic_sandbox.sdk.errors import ApiError, ConnectionFailed, SandboxError, from_response
from agentic_sandbox.sdk.models import Output, SessionExit
from agentic_sandbox.sdk.transport import Transport

SUBPROTOCOL = "sandbox.pty.v1"
_OFFSET = struct.Struct(">Q")
Role = Literal["control", "observe"]
ControlHandler = Callable[[dict[str, Any]], None]


class NotController(SandboxError):
    """Input, resize and signals need the controller role; this attachment observes."""


@dataclass(frozen=True)
class Resync:
    """The server skipped this client ahead to `offset` and sent the screen instead of bytes:
    `reason` is `initial` (attached without an offset), `offset-unavailable` (the requested
    offset is no longer held) or `behind` (this client fell too far behind)."""

    reason: str
    offset: int
    screen: str


class Attachment:
    """One client of a session's terminal; see the module doc."""

    def __init__(
        self,
        transport: Transport,
        session_id: str,
        *,
        role: Role = "control",
        from_offset: int | None = None,
        force: bool = False,
        on_control: ControlHandler | None = None,
        reconnect_within: float = 60.0,
    ) -> None:
        if role not in ("control", "observe"):
            raise ValueError("role is 'control' or 'observe'")
        self._t = transport
        self.session_id = session_id
        self.requested_role: Role = role
        self.next_offset: int | None = from_offset
        self._force = force
        self._on_control = on_control
        self.reconnect_within = reconnect_within
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self.role: str | None = None  # "controller" or "observer", from the server
        self.hello: dict[str, Any] = {}
        self.members: list[dict[str, Any]] = []
        self.cols: int | None = None
        self.rows: int | None = None
        self.resyncs: list[Resync] = []
        self.errors: list[dict[str, Any]] = []
        self.exit: SessionExit | None = None
        self.connects = 0  # how many times the WebSocket was opened (1 + reconnects)

    # ---- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> Attachment:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the WebSocket (again, from `next_offset` once output has been read)."""
        params: dict[str, str] = {"role": self.requested_role}
        if self.next_offset is not None:
            params["from"] = str(self.next_offset)
        protocols = [SUBPROTOCOL]
        if self._t.token:
            protocols.append(f"bearer.{self._t.token}")
        await self._t.resolve_leader()  # a WebSocket cannot follow a follower's 307
        url = f"{self._t.ws_url}/api/v2/admin/sessions/{self.session_id}/attach"
        try:
            ws = await self._t.session.ws_connect(
                url, params=params, protocols=protocols, compress=0, heartbeat=30
            )
        except aiohttp.WSServerHandshakeError as exc:
            raise await self._refusal(exc.status, exc.message) from None
        except (aiohttp.ClientConnectionError, OSError) as exc:
            self._t.forget_leader()
            raise ConnectionFailed(f"cannot attach to {self.session_id}: {exc}") from None
        self._ws = ws
        self.connects += 1
        if self._force and self.requested_role == "control":
            await ws.send_str(json.dumps({"type": "request_control", "force": True}))
        # hello comes first: read it so `role` is known before anyone sends
        while self.role is None or not self.hello:
            msg = await ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                self._ws = None
                raise ConnectionFailed(f"attach to {self.session_id}: no hello from the server")
            self._control(json.loads(msg.data))
        self._connected.set()

    async def _refusal(self, status: int, message: str) -> ApiError:
        """The handshake's refusal, with the server's problem document when a plain GET of the
        session says more (a WebSocket client does not get the refused response's body)."""
        if status < 500:
            try:
                await self._t.request("GET", f"/api/v2/admin/sessions/{self.session_id}")
            except ApiError as exc:
                return exc
        return from_response(status, message.encode())

    async def close(self) -> None:
        """Detach (the session keeps running)."""
        self._closing = True
        ws, self._ws = self._ws, None
        self._connected.clear()
        if ws is not None:
            await ws.close()

    @property
    def closed(self) -> bool:
        return self._closing or self.exit is not None

    # ---- reading ------------------------------------------------------------------------------
    def __aiter__(self) -> Attachment:
        return self

    async def __anext__(self) -> Output:
        while True:
            if self.exit is not None or self._closing:
                raise StopAsyncIteration
            ws = self._ws
            if ws is None:
                await self._reconnect()
                continue
            try:
                msg = await ws.receive()
            except (TimeoutError, aiohttp.ClientConnectionError, ConnectionError):
                msg = None
            if msg is not None and msg.type == aiohttp.WSMsgType.BINARY:
                (offset,) = _OFFSET.unpack_from(msg.data)
                out = Output(offset, bytes(msg.data[8:]))
                self.next_offset = out.end
                return out
            if msg is not None and msg.type == aiohttp.WSMsgType.TEXT:
                self._control(json.loads(msg.data))
                if self.exit is not None:  # after the last byte: this client is done
                    self._ws = None
                    self._connected.clear()
                    await ws.close()
                continue
            # closed, closing or broken: the connection is gone
            self._ws = None
            self._connected.clear()
            with contextlib.suppress(Exception):
                await ws.close()

    async def _reconnect(self) -> None:
        deadline = time.monotonic() + self.reconnect_within
        delay = 0.1
        while True:
            try:
                await self.connect()
                return
            except ConnectionFailed:
                pass
            except ApiError as exc:
                if exc.status < 500 and exc.status != 429:
                    raise  # gone, revoked, forbidden: reattaching cannot help
            if time.monotonic() + delay > deadline:
                raise ConnectionFailed(
                    f"lost the connection to session {self.session_id} and could not reattach "
                    f"within {self.reconnect_within:.0f}s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _control(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "hello":
            self.hello = msg
            self.role = msg.get("role")
            self.cols, self.rows = msg.get("cols"), msg.get("rows")
            self.members = list(msg.get("members") or [])
            start = msg.get("from")
            if isinstance(start, int):
                self.next_offset = start
        elif kind == "role":
            self.role = msg.get("role")
        elif kind == "members":
            self.members = list(msg.get("members") or [])
        elif kind == "resize":
            self.cols, self.rows = msg.get("cols"), msg.get("rows")
        elif kind == "resync" and isinstance(msg.get("offset"), int):
            self.next_offset = msg["offset"]
            self.resyncs.append(
                Resync(str(msg.get("reason", "")), msg["offset"], str(msg.get("screen") or ""))
            )
        elif kind == "error":
            self.errors.append(msg)
        elif kind == "exit":
            self.exit = SessionExit(
                msg.get("code"),
                msg.get("signal"),
                str(msg.get("reason") or ""),
                bool(msg.get("lost")),
            )
        if self._on_control is not None:
            self._on_control(msg)

    # ---- writing ------------------------------------------------------------------------------
    async def _send(self, frame: bytes | str, *, controller: bool = True) -> None:
        deadline = time.monotonic() + self.reconnect_within
        while True:
            if self.closed:
                raise ConnectionFailed(f"the attachment to {self.session_id} is closed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._connected.wait()
            ws = self._ws
            if ws is None:
                raise ConnectionFailed(f"not attached to {self.session_id}")
            if controller and self.role != "controller":
                raise NotController(
                    f"this client is the session's {self.role}; input, resize and signals "
                    "need control (request_control)"
                )
            try:
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_str(frame)
                return
            except (ConnectionError, aiohttp.ClientConnectionError):
                self._connected.clear()  # not sent: the reader reconnects, then we try again
                if time.monotonic() > deadline:
                    raise ConnectionFailed(f"lost the connection to {self.session_id}") from None

    async def send(self, data: bytes | str) -> None:
        """Type into the terminal (controller only)."""
        await self._send(data.encode() if isinstance(data, str) else data)

    async def resize(self, cols: int, rows: int) -> None:
        await self._send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def signal(self, name: Literal["INT", "TERM", "KILL", "HUP"]) -> None:
        """Signal the session's foreground process group."""
        await self._send(json.dumps({"type": "signal", "signal": name}))

    async def request_control(self, force: bool = False) -> None:
        """Ask for the controller lease (`force`: take it; operators and admins only)."""
        await self._send(json.dumps({"type": "request_control", "force": force}), controller=False)

    async def release_control(self) -> None:
        await self._send(json.dumps({"type": "release_control"}), controller=False)
