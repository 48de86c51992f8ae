"""SSH forward ports: one 127.0.0.1 port per instance, unique per host, recorded in metadata."""

from __future__ import annotations

import random
import socket
import threading

from .errors import NoCapacity


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out ports from ``[low, high]``. ``probe_local``: also skip ports in use on this
    machine (true for hosts whose loopback is this machine's). Such a machine may run several
    fleets (a server and `provision-vm.sh --no-server`, parallel test lanes): each starts at a
    random point of the range, so two of them rarely probe the same free port in the moment
    before either QEMU binds it."""

    def __init__(self, low: int, high: int, *, probe_local: bool) -> None:
        self.low, self.high = low, high
        self.probe_local = probe_local
        self._used: set[int] = set()
        self._lock = threading.Lock()
        self._next = low + random.randrange(high - low + 1) if probe_local else low

    def claim(self, port: int) -> None:
        """Mark a port as taken (an instance found in libvirt uses it)."""
        with self._lock:
            self._used.add(port)

    def allocate(self) -> int:
        with self._lock:
            span = self.high - self.low + 1
            for i in range(span):
                port = self.low + (self._next - self.low + i) % span
                if port in self._used:
                    continue
                if self.probe_local and not _bindable(port):
                    continue
                self._used.add(port)
                self._next = port + 1 if port < self.high else self.low
                return port
        raise NoCapacity(f"no free SSH forward port in {self.low}-{self.high}")

    def release(self, port: int | None) -> None:
        if port is None:
            return
        with self._lock:
            self._used.discard(port)

    def in_use(self) -> set[int]:
        with self._lock:
            return set(self._used)
