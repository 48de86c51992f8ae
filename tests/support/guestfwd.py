"""A stand-in for a QEMU guest forward, for tests on the host: what the agent dials as its
gateway, carried to the server over ONE persistent connection (as slirp's `guestfwd` does with
its chardev): every agent connection in turn rides the same pipe, bytes from the server go to
the newest agent connection — and while none is open they wait for the next one (slirp reads
the chardev only into a guest connection) — and when the pipe breaks it is made again after a
second (`reconnect=1`), whatever the agent's connections are doing.

    fwd = GuestForward(server.guest_link_target).start()    # its own thread and loop
    agent = AgentProcess(..., extra_args=["--gateway", fwd.address])
    fwd.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class GuestForward:
    def __init__(self, gateway: str, reconnect: float = 1.0) -> None:
        host, _, port = gateway.rpartition(":")
        self.gateway = (host, int(port))
        self.reconnect = reconnect
        self.server: asyncio.Server | None = None
        self.pipe: asyncio.StreamWriter | None = None
        self.guests: list[asyncio.StreamWriter] = []
        self.held = bytearray()  # from the pipe while no guest connection was open
        self.pipes_made = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> GuestForward:
        """Run in a thread of its own (tests block their own loop with synchronous calls)."""
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="guestfwd", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._guest, "127.0.0.1", 0)
        self._spawn(self._keep_pipe())

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keep_pipe(self) -> None:
        while not self._stopping:
            try:
                reader, writer = await asyncio.open_connection(*self.gateway)
            except OSError:
                await asyncio.sleep(self.reconnect)
                continue
            self.pipe = writer
            self.pipes_made += 1
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(65536):
                    if self.guests:  # slirp: to the (newest) guest connection
                        self.guests[-1].write(data)
                    else:  # ... or, with none open, to the next one
                        self.held += data
            self.pipe = None
            self.held.clear()  # a new pipe: what the old one held is gone with it
            writer.close()
            if not self._stopping:
                await asyncio.sleep(self.reconnect)

    async def _guest(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.guests.append(writer)
        if self.held:
            writer.write(bytes(self.held))
            self.held.clear()
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(65536):
                    if self.pipe is not None:  # a broken pipe loses what is written meanwhile
                        self.pipe.write(data)
        finally:
            self.guests.remove(writer)
            writer.close()

    def remake_pipe(self) -> None:
        """Drop the host connection and make it again (what QEMU does after a memory restore,
        or when its chardev reconnects): the guest's connection stays open, leading nowhere."""
        fut = asyncio.run_coroutine_threadsafe(self._drop_pipe(), self._loop)
        fut.result(10)

    async def _drop_pipe(self) -> None:
        made = self.pipes_made
        if self.pipe is not None:
            self.pipe.close()
        async with asyncio.timeout(10):
            while self.pipes_made == made:
                await asyncio.sleep(0.01)

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        self._stopping = True
        if self.server is not None:
            self.server.close()
        for w in list(self.guests):
            w.close()
        if self.pipe is not None:
            self.pipe.close()
        for task in list(self._tasks):
            task.cancel()
