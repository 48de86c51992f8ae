"""Ports: one TCP connection to a port on the guest's loopback per stream (kind `port`).

The server opens the stream (its reverse proxy, a `port-forward` tunnel); the agent connects to
127.0.0.1:PORT — never another address, whatever the open says — and accepts the stream only
once connected: a refused connect is a close with `connection-refused` (a timeout
`connect-timeout`, anything else `connect-failed`), never a hang. Channel 0 carries the bytes
to the port, channel 1 the bytes from it; each direction ends with its channel's eof (a TCP
half-close); once both directions ended the socket is closed. The stream ends, with the byte
counts, when the socket is gone and everything read from it was sent.

Flow control is the stream's credit both ways, with no per-byte work: the socket's reads (as
asyncio hands them, up to 256 KiB) are sent in frames of at most 64 KiB while the server
grants room, and reading pauses when it grants none; what the server sends is written to the
socket and credited back only once the socket's buffer drains (`resume_writing`).
"""

from __future__ import annotations

import asyncio
import errno
import logging

from agentic_sandbox.agent.streams import BASE_FRAME, Stream, StreamRefused
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the only address a port stream reaches
TO_PORT, FROM_PORT = 0, 1
CONNECT_TIMEOUT = 10.0
FRAME = BASE_FRAME  # frames of what the port sends: the largest every receiver takes
WINDOW = 1024 * 1024  # what the server may send towards the port before credit


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise StreamRefused("bad-port", f"port {port} is outside 1-65535", "port")
    return port


class PortRelay(asyncio.Protocol):
    """One stream's connection (the stream's handler and the socket's protocol)."""

    def __init__(self, stream: Stream, port: int) -> None:
        self.stream = stream
        self.port = port
        self._transport: asyncio.Transport | None = None
        self._pending = b""  # read from the socket, not yet sent (no credit) from `_sent`
        self._sent = 0
        self._eof_pending = False  # the port half-closed; send it after the pending bytes
        self._eof_sent = False
        self._eof_in = False  # the server ended its direction (the port was sent EOF)
        self._socket_gone = False
        self._owed = 0  # written to the socket, credited once its buffer drains
        self._write_paused = False
        self._done = False
        self.bytes_in = 0
        self.bytes_out = 0
        self._connect = asyncio.ensure_future(self._dial())

    @classmethod
    def open(cls, stream: Stream, msg: pb.StreamOpen) -> tuple[PortRelay, None]:
        port = check_port(msg.port.port)
        stream.window = WINDOW
        return cls(stream, port), None

    async def _dial(self) -> None:
        loop = asyncio.get_running_loop()
        where = f"{HOST}:{self.port}"
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await loop.create_connection(lambda: self, HOST, self.port)
        except asyncio.CancelledError:
            return
        except TimeoutError:
            self._refuse("connect-timeout", f"{where} did not answer in {CONNECT_TIMEOUT:g} s")
        except ConnectionRefusedError:
            self._refuse("connection-refused", f"nothing listens on {where} in the guest")
        except OSError as exc:
            reason = errno.errorcode.get(exc.errno or 0, "") or type(exc).__name__
            self._refuse("connect-failed", f"connecting to {where} failed: {reason} {exc}")

    def _refuse(self, code: str, message: str) -> None:
        if not self._done:
            self._done = True
            self.stream.fail(code, message, "port")

    # ---- the socket ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self._done:  # cancelled while connecting
            transport.abort()
            return
        self._transport = transport
        self.stream.accept(pb.StreamAccept(port=pb.PortConnected()))
        self._flow()

    def data_received(self, data: bytes) -> None:
        # reading pauses while anything is pending, so this join is rare (and small)
        self._pending = self._pending[self._sent :] + data if self._pending else data
        self._sent = 0
        self._flush()

    def eof_received(self) -> bool:
        self._eof_pending = True
        self._flush()
        return True  # keep writing towards the port until the server ends its side

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._socket_gone = True
        self._eof_pending = True
        self._flush()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._owed:
            self.stream.consumed(TO_PORT, self._owed)
            self._owed = 0

    def _flow(self) -> None:
        transport = self._transport
        if transport is None or self._eof_pending:
            return
        if self._sent < len(self._pending):
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _flush(self) -> None:
        if self._done or (self._transport is None and not self._socket_gone):
            return
        stream = self.stream
        pending, sent = self._pending, self._sent
        while sent < len(pending):
            n = min(stream.room(FROM_PORT), FRAME, len(pending) - sent)
            if n <= 0:
                break
            whole = sent == 0 and n == len(pending)
            stream.send(FROM_PORT, pending if whole else pending[sent : sent + n])
            sent += n
            self.bytes_out += n
        if sent >= len(pending):
            self._pending, self._sent = b"", 0
        else:
            self._sent = sent
        if not self._pending and self._eof_pending and not self._eof_sent:
            self._eof_sent = True
            stream.send(FROM_PORT, b"", eof=True)
            if self._eof_in and self._transport is not None:
                self._transport.close()  # both directions are done: connection_lost follows
        if self._eof_sent and self._socket_gone:
            self._finish()
            return
        self._flow()

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self.stream.finish(
            pb.StreamClose(port=pb.PortResult(bytes_in=self.bytes_in, bytes_out=self.bytes_out))
        )

    # ---- the stream (StreamHandler) -------------------------------------------------------
    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        if channel != TO_PORT:
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            self.stream.consumed(TO_PORT, len(data))  # the port is gone: drop, keep granting
            return
        if data:
            self.bytes_in += len(data)
            transport.write(data)
            if self._write_paused:
                self._owed += len(data)
            else:
                self.stream.consumed(TO_PORT, len(data))
        if eof:
            self._eof_in = True
            try:
                if self._eof_sent or not transport.can_write_eof():
                    transport.close()  # after what was written (close flushes)
                else:
                    transport.write_eof()
            except OSError:
                transport.close()

    def on_credit(self, channel: int) -> None:
        if channel == FROM_PORT:
            self._flush()

    def on_close(self, error: pb.StreamError | None) -> None:
        """A cancel from the server, or the link lost: the connection ends at once."""
        self._connect.cancel()
        if error is not None and error.code not in ("", "canceled", "link-lost"):
            log.info("port %d stream ended: %s %s", self.port, error.code, error.message)
        if self._transport is not None:
            self._transport.abort()
            self._transport = None
        self._pending, self._sent = b"", 0
        self._finish()
