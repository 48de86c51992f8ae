"""An async client of the session WebSocket (`sandbox.pty.v1`) for tests and benchmarks.

It checks the protocol as it reads: every binary frame must start exactly where the previous
one ended (or at the offset a `resync` named), so a gap or a duplicate fails loudly.

    async with PtyClient.connect(server.ws_url, sid, token, role="control") as c:
        await c.send_input(b"echo hi\\r")
        await c.wait_output(b"hi")
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import aiohttp

SUBPROTOCOL = "sandbox.pty.v1"


class ProtocolViolation(AssertionError):
    pass


class PtyClient:
    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._http = http
        self.ws = ws
        self.hello: dict[str, Any] = {}
        self.controls: list[dict[str, Any]] = []
        self.data = bytearray()  # output bytes received since `start`
        self.start: int | None = None  # offset of data[0]
        self.next: int | None = None  # offset expected next
        self.resyncs: list[dict[str, Any]] = []
        self.frames = 0
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self.keep_data = True
        self.on_frame: Callable[[int, bytes], None] | None = None

    @classmethod
    async def connect(
        cls,
        base_ws_url: str,
        session_id: str,
        token: str | None,
        *,
        role: str = "observe",
        from_offset: int | None = None,
        cookies: dict[str, str] | None = None,
        timeout: float = 15.0,
        subprotocols: tuple[str, ...] | None = None,
    ) -> PtyClient:
        params: dict[str, str] = {"role": role}
        if from_offset is not None:
            params["from"] = str(from_offset)
        protocols = subprotocols or ((SUBPROTOCOL, f"bearer.{token}") if token else (SUBPROTOCOL,))
        http = aiohttp.ClientSession(cookies=cookies)
        try:
            ws = await http.ws_connect(
                f"{base_ws_url}/api/v2/admin/sessions/{session_id}/attach",
                params=params,
                protocols=protocols,
                compress=0,
                max_msg_size=64 * 1024 * 1024,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
                autoping=True,
            )
        except BaseException:
            await http.close()
            raise
        client = cls(http, ws)
        client._reader = asyncio.create_task(client._read())
        await client.wait_control("hello", timeout=timeout)
        client.hello = next(c for c in client.controls if c["type"] == "hello")
        return client

    async def __aenter__(self) -> PtyClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if not self.ws.closed:
            await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            except ProtocolViolation:
                await self._http.close()
                raise  # a short frame or an offset gap fails the test, even at its close
            except Exception:
                pass  # the socket ending mid-read is how a close goes
        await self._http.close()

    # ---- reading ------------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    self._frame(msg.data)
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    ctl = json.loads(msg.data)
                    if ctl.get("type") == "hello" and ctl.get("from") is not None:
                        self.start = self.next = int(ctl["from"])
                    if ctl.get("type") == "resync":
                        self.resyncs.append(ctl)
                        if self.start is None:
                            self.start = int(ctl["offset"])
                        self.next = int(ctl["offset"])
                    self.controls.append(ctl)
                else:
                    break
                self._changed.set()
        finally:
            self.close_code = self.ws.close_code
            self.closed.set()
            self._changed.set()

    def _frame(self, frame: bytes) -> None:
        if len(frame) < 8:
            raise ProtocolViolation("binary frame shorter than its 8-byte offset")
        (offset,) = struct.unpack_from(">Q", frame)
        if self.next is None:
            self.start = self.next = offset
        if offset != self.next:
            raise ProtocolViolation(f"frame at offset {offset}, expected {self.next}")
        payload = memoryview(frame)[8:]
        if self.keep_data:
            self.data += payload
        self.next = offset + len(payload)
        self.frames += 1
        if self.on_frame is not None:
            self.on_frame(offset, bytes(payload))

    async def _wait(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if self._reader is not None and self._reader.done() and not pred():
                exc = self._reader.exception()
                if exc is not None:
                    raise exc
                raise AssertionError(f"connection closed while waiting for {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"timed out waiting for {what}; last controls: "
                    f"{self.controls[-5:]}; data tail: {bytes(self.data[-300:])!r}"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    async def wait_output(self, needle: bytes, timeout: float = 15.0) -> None:
        await self._wait(lambda: needle in self.data, timeout, f"output {needle!r}")

    async def wait_offset(self, offset: int, timeout: float = 30.0) -> None:
        await self._wait(lambda: (self.next or 0) >= offset, timeout, f"offset {offset}")

    async def wait_control(
        self,
        kind: str,
        timeout: float = 15.0,
        pred: Callable[[dict[str, Any]], bool] | None = None,
        after: int = 0,
    ) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            for ctl in self.controls[after:]:
                if ctl.get("type") == kind and (pred is None or pred(ctl)):
                    return ctl
            return None

        await self._wait(lambda: find() is not None, timeout, f"control {kind}")
        found = find()
        assert found is not None
        return found

    def errors(self) -> list[dict[str, Any]]:
        return [c for c in self.controls if c.get("type") == "error"]

    # ---- writing ------------------------------------------------------------------------------
    async def send_input(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def send_json(self, obj: Any) -> None:
        await self.ws.send_str(json.dumps(obj))

    async def send_text(self, text: str) -> None:
        await self.ws.send_str(text)
