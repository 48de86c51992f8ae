"""The agent's per-session output ring: the last N bytes of a PTY's output, by stream offset.

The agent may only overwrite bytes the server has acknowledged; the session's reader stops
reading the PTY when the unacknowledged backlog would not fit (flow control). Appends and
reads are slice copies; nothing walks the data byte by byte.
"""

from __future__ import annotations

INITIAL_BYTES = 64 * 1024


class Ring:
    __slots__ = ("_buf", "capacity", "end", "start")

    def __init__(self, capacity: int) -> None:
        if capacity < 4096:
            raise ValueError("ring capacity must be at least 4096 bytes")
        self.capacity = capacity
        self._buf = bytearray(min(INITIAL_BYTES, capacity))
        self.start = 0
        self.end = 0

    def _place(self, offset: int, data: bytes | memoryview) -> None:
        size = len(self._buf)
        n = len(data)
        pos = offset % size
        first = min(n, size - pos)
        view = memoryview(data)
        self._buf[pos : pos + first] = view[:first]
        if first < n:
            self._buf[0 : n - first] = view[first:]

    def append(self, data: bytes) -> None:
        n = len(data)
        if n == 0:
            return
        if n > self.capacity:
            raise ValueError("append larger than the ring")
        need = self.end + n - self.start
        if need > len(self._buf) and len(self._buf) < self.capacity:
            held = self.read(self.start, self.end - self.start)
            self._buf = bytearray(min(self.capacity, max(need, 2 * len(self._buf))))
            self._place(self.start, held)
        self._place(self.end, data)
        self.end += n
        if self.end - self.start > len(self._buf):
            self.start = self.end - len(self._buf)

    def read(self, offset: int, max_bytes: int) -> bytes:
        if offset < self.start or offset > self.end:
            raise ValueError(f"offset {offset} not held ({self.start}..{self.end})")
        n = min(max_bytes, self.end - offset)
        if n <= 0:
            return b""
        size = len(self._buf)
        pos = offset % size
        first = min(n, size - pos)
        mv = memoryview(self._buf)
        if first < n:
            return b"".join((mv[pos : pos + first], mv[0 : n - first]))
        return bytes(mv[pos : pos + n])
