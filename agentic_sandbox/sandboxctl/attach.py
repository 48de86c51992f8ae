"""`sandboxctl session attach`: this terminal becomes the session's terminal.

Raw mode; keystrokes go out at once; output goes to stdout; SIGWINCH sends a resize. The
detach key (default Ctrl-]) leaves the session running. The SDK's attachment reattaches a
dropped connection from the next offset, so nothing is lost or doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from typing import Any

from agentic_sandbox.sandboxctl.exits import EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError
from agentic_sandbox.sdk import AsyncClient, NotController


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


def _terminal_size() -> tuple[int, int]:
    if sys.stdout.isatty():
        size = os.get_terminal_size()
        return size.columns, size.lines
    return 80, 24


async def attach(
    client: AsyncClient, session_id: str, *, observe: bool, force: bool, detach_key: str
) -> int:
    key = detach_byte(detach_key)
    if not client.credentials.token:
        raise CliError("attach needs a token (--token, $SANDBOX_TOKEN or a context)")
    out = sys.stdout.buffer
    resized = asyncio.Event()

    def on_control(msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "hello":
            resized.set()  # each (re)attach tells the session this terminal's size
        elif kind == "error":
            sys.stderr.write(f"\r\n[{msg.get('code')}: {msg.get('message')}]\r\n")
        elif kind == "role" and msg.get("role"):
            sys.stderr.write(f"\r\n[you are now {msg.get('role')}]\r\n")
        elif kind == "resync" and isinstance(msg.get("screen"), str):
            out.write(b"\x1b[2J\x1b[H" + msg["screen"].encode())  # redraw the server's screen
            out.flush()

    term = client.sessions.attach(
        session_id,
        role="observe" if observe else "control",
        force=force,
        on_control=on_control,
    )
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    interactive = sys.stdin.isatty()
    saved = termios.tcgetattr(fd) if interactive else None
    typed: asyncio.Queue[bytes] = asyncio.Queue(maxsize=256)
    detached = False

    def on_stdin() -> None:
        data = os.read(fd, 4096)
        if not data:
            loop.remove_reader(fd)
            return
        with contextlib.suppress(asyncio.QueueFull):
            typed.put_nowait(data)

    async def read_file() -> None:
        """stdin is a file (or /dev/null), which the loop cannot watch: read it in a thread."""
        while data := await loop.run_in_executor(None, os.read, fd, 4096):
            await typed.put(data)

    async def send_input() -> None:
        nonlocal detached
        while True:
            data = await typed.get()
            cut = data.find(bytes([key]))
            if cut >= 0:
                if data[:cut] and not observe:
                    with contextlib.suppress(NotController):
                        await term.send(data[:cut])
                detached = True
                await term.close()
                return
            if not observe:
                with contextlib.suppress(NotController):  # another client took control
                    await term.send(data)

    async def send_resize() -> None:
        while True:
            await resized.wait()
            resized.clear()
            if not observe and term.role == "controller":
                with contextlib.suppress(NotController):
                    await term.resize(*_terminal_size())

    await term.connect()
    tasks: list[asyncio.Task[None]] = []
    try:
        if interactive:
            tty.setraw(fd)
            loop.add_signal_handler(signal.SIGWINCH, resized.set)
        tasks = [asyncio.create_task(send_input()), asyncio.create_task(send_resize())]
        try:
            loop.add_reader(fd, on_stdin)
        except PermissionError:
            tasks.append(asyncio.create_task(read_file()))
        print(f"[attached to {session_id}; detach with {detach_key}]\r", file=sys.stderr)
        async for chunk in term:
            out.write(chunk.data)
            out.flush()
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        loop.remove_reader(fd)
        if interactive:
            loop.remove_signal_handler(signal.SIGWINCH)
            assert saved is not None
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        await term.close()
    if detached:
        print(f"\n[detached from {session_id}; it keeps running]", file=sys.stderr)
        return EXIT_OK
    if term.exit is not None:
        code = term.exit.code if term.exit.code is not None else 128
        print(f"\n[session exited with {code}]", file=sys.stderr)
        return EXIT_OK if code == 0 else EXIT_ERROR
    return EXIT_ERROR
