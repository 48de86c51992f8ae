"""`sandboxctl session attach`: this terminal becomes the session's terminal.

Raw mode, keystrokes go out at once as binary frames, output frames (8-byte offset + bytes) go
to stdout, SIGWINCH sends `resize`. The detach key (default Ctrl-]) leaves the session running.
On a dropped connection it reattaches with `from=<next offset>`, so nothing is lost or doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import struct
import sys
import termios
import tty
from typing import Any

import aiohttp

from agentic_sandbox.sandboxctl.client import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Api, CliError

SUBPROTOCOL = "sandbox.pty.v1"


def detach_byte(spec: str) -> int:
    spec = spec.lower().strip()
    if spec.startswith("ctrl-") and len(spec) == 6:
        ch = spec[5]
        code = (
            ord(ch.upper()) - 64 if ch.isalpha() else {"]": 29, "\\": 28, "^": 30, "_": 31}.get(ch)
        )
        if code is not None and 0 < code < 32:
            return code
    raise CliError(f"--detach-key must look like ctrl-] or ctrl-q, got {spec!r}", EXIT_USAGE)


async def attach(api: Api, session_id: str, *, observe: bool, force: bool, detach_key: str) -> int:
    key = detach_byte(detach_key)
    if not api.target.token:
        raise CliError("attach needs a token (--token, $SANDBOX_TOKEN or a context)")
    base = api.target.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    url = f"{base}/api/v2/admin/sessions/{session_id}/attach"
    interactive = sys.stdin.isatty()
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if interactive else None
    loop = asyncio.get_running_loop()
    next_offset: int | None = None
    stdin_queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=256)
    resized = asyncio.Event()
    detached = False
    exit_code: int | None = None

    def on_stdin() -> None:
        data = os.read(fd, 4096)
        if not data:
            loop.remove_reader(fd)
            return
        with contextlib.suppress(asyncio.QueueFull):
            stdin_queue.put_nowait(data)

    try:
        if interactive:
            tty.setraw(fd)
            loop.add_signal_handler(signal.SIGWINCH, resized.set)
        loop.add_reader(fd, on_stdin)
        print(f"[attached to {session_id}; detach with {detach_key}]\r", file=sys.stderr)
        for _attempt in range(30):
            params: dict[str, Any] = {"role": "observe" if observe else "control"}
            if next_offset is not None:
                params["from"] = next_offset
            try:
                async with api.session.ws_connect(
                    url,
                    params=params,
                    protocols=(SUBPROTOCOL, f"bearer.{api.target.token}"),
                    compress=0,
                    heartbeat=30,
                ) as ws:
                    if force and not observe:
                        await ws.send_str(json.dumps({"type": "request_control", "force": True}))
                    resized.set()
                    outcome = await _pump(ws, stdin_queue, resized, key, observe)
                    next_offset = outcome.get("next_offset", next_offset)
                    if outcome.get("detached"):
                        detached = True
                        break
                    if "exit" in outcome:
                        exit_code = outcome["exit"]
                        break
            except aiohttp.WSServerHandshakeError as exc:
                raise CliError(f"cannot attach: HTTP {exc.status} {exc.message}") from None
            except aiohttp.ClientConnectorError as exc:
                raise CliError(f"cannot reach the server: {exc.os_error}") from None
            await asyncio.sleep(0.5)  # connection dropped: reattach from the next offset
    finally:
        loop.remove_reader(fd)
        if interactive:
            loop.remove_signal_handler(signal.SIGWINCH)
            assert saved is not None
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    if detached:
        print(f"\n[detached from {session_id}; it keeps running]", file=sys.stderr)
        return EXIT_OK
    if exit_code is not None:
        print(f"\n[session exited with {exit_code}]", file=sys.stderr)
        return EXIT_OK if exit_code == 0 else EXIT_ERROR
    return EXIT_ERROR


async def _pump(
    ws: aiohttp.ClientWebSocketResponse,
    stdin_queue: asyncio.Queue[bytes],
    resized: asyncio.Event,
    key: int,
    observe: bool,
) -> dict[str, Any]:
    out = sys.stdout.buffer
    result: dict[str, Any] = {}

    async def send_input() -> None:
        while True:
            data = await stdin_queue.get()
            if key in data:
                data = data[: data.index(key)]
                if data and not observe:
                    await ws.send_bytes(data)
                result["detached"] = True
                await ws.close()
                return
            if not observe:
                await ws.send_bytes(data)

    async def send_resize() -> None:
        while True:
            await resized.wait()
            resized.clear()
            if observe:
                continue
            size = os.get_terminal_size() if sys.stdout.isatty() else os.terminal_size((80, 24))
            await ws.send_str(
                json.dumps({"type": "resize", "cols": size.columns, "rows": size.lines})
            )

    tasks = [asyncio.create_task(send_input()), asyncio.create_task(send_resize())]
    try:
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                (offset,) = struct.unpack_from(">Q", msg.data)
                payload = msg.data[8:]
                out.write(payload)
                out.flush()
                result["next_offset"] = offset + len(payload)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                ctl = json.loads(msg.data)
                kind = ctl.get("type")
                if kind == "exit":
                    result["exit"] = ctl.get("code") if ctl.get("code") is not None else 128
                    break
                if kind == "error":
                    sys.stderr.write(f"\r\n[{ctl.get('code')}: {ctl.get('message')}]\r\n")
                elif kind == "role":
                    sys.stderr.write(f"\r\n[you are now {ctl.get('role')}]\r\n")
                elif kind == "hello" and result.get("next_offset") is None:
                    start = ctl.get("from")  # where this attach's stream begins (None: a snapshot)
                    if isinstance(start, int):
                        result["next_offset"] = start
                elif kind == "resync" and isinstance(ctl.get("offset"), int):
                    result["next_offset"] = ctl["offset"]
                    screen = ctl.get("screen")
                    if isinstance(screen, str):  # redraw from the server's screen snapshot
                        out.write(b"\x1b[2J\x1b[H" + screen.encode())
                        out.flush()
            elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                break
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    return result
