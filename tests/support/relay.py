"""A loopback TCP relay in front of a server, whose connections a test can cut or slow: a
dropped or a slow network, as a client sees it, without touching the server.

    relay = CuttingRelay(server.http_port, cut_after=50_000)   # cut the 1st connection once
    await relay.start()                                           # relay.url: its address
    ...
    relay.cuts                                                     # how many it cut
    await relay.stop()

With `cut_after`, the first connection that has carried that many bytes from the server is
closed (both sides, at once); later connections pass untouched. `cut_all()` closes every open
connection now. `delay` (seconds, settable at any time) holds what the server sends for that
long before the client gets it, in order: a slow path back, as a starved guest sees its link.
"""

from __future__ import annotations

import asyncio
import contextlib


class CuttingRelay:
    def __init__(self, upstream_port: int, *, cut_after: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.delay = 0.0
        self.cuts = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._serving: set[asyncio.Task[None]] = set()  # a connection's task (held data waits)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> CuttingRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        self.cut_all(count=False)
        serving = list(self._serving)
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut_all(self, *, count: bool = True) -> None:
        for w in list(self._open):
            w.transport.abort()
        if count and self._open:
            self.cuts += 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._open |= {writer, up_writer}
        budget = self.cut_after if self.cuts == 0 else None

        # what the server sent, each chunk with the loop time it may go on (bounded: a full
        # queue stops reading from the server, as a full network path would)
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=256)

        async def release(dst: asyncio.StreamWriter) -> None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    due, data = await held.get()
                    if not data:
                        break
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            nonlocal budget
            loop = asyncio.get_running_loop()
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(4096):
                    if down and budget is None:
                        await held.put((loop.time() + self.delay, data))
                        continue
                    if down and budget is not None:
                        if len(data) >= budget and self.cuts == 0:
                            dst.write(data[:budget])
                            await dst.drain()
                            self.cuts += 1
                            writer.transport.abort()
                            up_writer.transport.abort()
                            break
                        budget -= len(data)
                    dst.write(data)
                    await dst.drain()
            if down:
                if not releaser.done():  # (one that failed to write reads no more)
                    await held.put((0.0, b""))  # the end, after what is held: release closes
                return
            with contextlib.suppress(Exception):
                dst.close()

        releaser = asyncio.create_task(release(writer))
        try:
            await asyncio.gather(
                pump(reader, up_writer, False), pump(up_reader, writer, True), releaser
            )
        finally:
            self._open -= {writer, up_writer}
            for w in (writer, up_writer):
                w.transport.abort()
