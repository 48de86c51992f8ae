"""The guest's way to the control plane over a virtio-serial port, when its machine has one.

The guest forward (10.0.2.2:<port>) goes through QEMU's user-mode network: every TCP segment
the guest sends is taken apart by slirp in QEMU's main loop and written to the forward's
chardev, a few KiB per wake-up. That loop, not the agent, is what held a file transfer into a
TCG guest to ~14 MB/s. A virtio-serial port (`org.agentic-sandbox.link`) is a chardev of the
same kind — QEMU connects it to the same guest link gateway, with the same reconnects — but
the guest hands it whole pages through a virtqueue, with no network stack on either side.

The port is a pipe with no connection boundaries, exactly as the forward's host side is: the
gateway protocol on top (a CONNECT per connection, the sync, the reset after a restore or a
server restart; `broker/agentlink/gateway.py`) is unchanged. So the agent bridges the port to a
loopback listener that behaves as the forward did — each accepted connection takes the pipe
over and the one before it is closed — and `channels.py` dials the bridge exactly as it dialed
the forward. The agent holds the port open for its lifetime: a port opens once at a time
(another open gets EBUSY) and its device is root's alone, and the bridge's listener is guarded
like the forward (root only, `guard.py`).

While QEMU's chardev has no host connection (between its reconnects), the port reads as end of
file and polls as hung up, and writes would block: the bridge then waits in short sleeps rather
than on readiness, which a hung-up port reports without end.

A connection lives no longer than the host connection it was spliced to, as a TCP connection
through a forward would: when the port's host side goes away (the server stopped, the machine
was saved), the bridge closes the connection at once, so the agent's link fails then — not
seconds later, when the next host connection's reset arrives — and its next connection waits
in the bridge, its first bytes unread, until a host side is there again. An agent whose server
restarts is back as soon as QEMU has reconnected the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import socket
import time

log = logging.getLogger("agent")

READ_BATCH = 256 * 1024  # a virtio port reads one page per call: gather up to this much
WRITE_BATCH = 256 * 1024
HOST_AWAY_POLL = 0.05  # seconds between looks at a port whose host side is not connected
OPEN_WAIT = 5.0  # a worker that is ending may still hold the port


class SerialBridge:
    """A loopback listener whose newest connection is spliced to the virtio-serial port."""

    def __init__(self, fd: int, listener: socket.socket) -> None:
        self._fd = fd
        self._listener = listener
        self._poll = select.poll()
        self._poll.register(fd, select.POLLHUP)
        self._current: asyncio.Task[None] | None = None
        self._accepting: asyncio.Task[None] | None = None
        host, port = listener.getsockname()[:2]
        self.address = f"{host}:{port}"

    @classmethod
    async def open(cls, device: str, host: str = "127.0.0.1") -> SerialBridge | None:
        """The bridge, or None when the machine has no such port (or it cannot be opened)."""
        deadline = time.monotonic() + OPEN_WAIT
        while True:
            try:
                fd = os.open(device, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
                break
            except FileNotFoundError:
                return None  # a machine without the port: the forward it is
            except OSError as exc:
                if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)  # the worker before this one is still ending
                    continue
                log.error("the link's port %s cannot be opened: %s", device, exc)
                return None
        try:
            listener = socket.create_server((host, 0), backlog=8)
        except OSError:
            os.close(fd)
            raise
        listener.setblocking(False)
        bridge = cls(fd, listener)
        bridge._accepting = asyncio.create_task(bridge._accept(), name="agent-serial-bridge")
        return bridge

    async def aclose(self) -> None:
        """Stop accepting, end the connection that has the pipe, then close the port."""
        tasks = [t for t in (self._accepting, self._current) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # ------------------------------------------------------------------ connections
    async def _accept(self) -> None:
        """One splice at a time: a new connection waits until the one before it has ended
        (its socket closed, its reads of the port stopped), then has the pipe."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors, an aborted connection: not the end
                log.warning("the link's bridge could not accept a connection: %s", exc)
                await asyncio.sleep(0.1)
                continue
            try:
                conn.setblocking(False)
                if self._current is not None:
                    self._current.cancel()
                    await asyncio.wait({self._current})
            except BaseException:
                conn.close()
                raise
            self._current = asyncio.create_task(self._splice(conn))

    async def _splice(self, conn: socket.socket) -> None:
        try:
            await self._host_here()  # the connection's first bytes wait for a host side
            down = asyncio.create_task(self._port_to(conn))
            up = asyncio.create_task(self._to_port(conn))
            try:
                await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (down, up):
                    task.cancel()
                for result in await asyncio.gather(down, up, return_exceptions=True):
                    if isinstance(result, Exception):
                        log.warning("the link's bridge: %s", result)
        finally:
            conn.close()

    async def _port_to(self, conn: socket.socket) -> None:
        """Until the port's host side goes away (the splice then ends, and with it `conn`)."""
        loop = asyncio.get_running_loop()
        view = memoryview(bytearray(READ_BATCH))
        while n := await self._read(view):
            await loop.sock_sendall(conn, view[:n])  # all of it sent before the next read

    async def _to_port(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        buf = memoryview(bytearray(WRITE_BATCH))
        while n := await loop.sock_recv_into(conn, buf):
            view = buf[:n]
            while view:
                try:
                    view = view[os.write(self._fd, view) :]
                except BlockingIOError:
                    await self._ready(write=True)

    # ------------------------------------------------------------------ the port
    async def _read(self, view: memoryview) -> int:
        """Read what the port holds into `view` (a page per call): at least one byte, or 0
        when the host side has gone away."""
        n = 0
        while n < len(view):
            try:
                got = os.readv(self._fd, [view[n:]])
            except BlockingIOError:
                if n or not await self._ready(write=False):  # (a host side going wakes it)
                    return n
                continue
            if got == 0:  # the host side is not connected (any more)
                return n
            n += got
        return n

    async def _host_here(self) -> None:
        """Until the port has a host side (at once when it has)."""
        while self._host_away():  # noqa: ASYNC110 (a hung-up port has no event to wait on)
            await asyncio.sleep(HOST_AWAY_POLL)

    async def _ready(self, *, write: bool) -> bool:
        """Wait until the port can be written (or read): True; or a short while when its host
        side is away (a hung-up port is always "ready"): False."""
        if self._host_away():
            await asyncio.sleep(HOST_AWAY_POLL)
            return False
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        add, remove = (
            (loop.add_writer, loop.remove_writer)
            if write
            else (loop.add_reader, loop.remove_reader)
        )

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        add(self._fd, wake)
        try:
            await ready
        finally:
            remove(self._fd)
        return True

    def _host_away(self) -> bool:
        return any(ev & select.POLLHUP for _, ev in self._poll.poll(0))
