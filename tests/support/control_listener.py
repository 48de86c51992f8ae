"""What stands for the guest link gateway in fleet tests: a TCP server on a host's control
address that answers a line with "pong" and records each peer and what it sent (the tiny
guest's ``sbx.probe`` speaks to it through its forward)."""

from __future__ import annotations

import contextlib
import socket
import threading


class ControlListener:
    """Stands for the guest link gateway on the host's control address: answers a line with
    "pong" and records each peer and what it sent."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[tuple[str, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn, peer[0]), daemon=True).start()

    def _handle(self, conn: socket.socket, peer: str) -> None:
        with conn:
            conn.settimeout(120)
            with contextlib.suppress(OSError):
                data = conn.recv(4096)
                if data:
                    self.received.append((peer, data))
                    conn.sendall(b"pong\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
