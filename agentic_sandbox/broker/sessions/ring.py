"""A session's output ring: the last N bytes of a byte stream, addressed by stream offset.

Appends and reads are slice copies (C speed); nothing walks the data byte by byte. The buffer
starts small and grows to its capacity, so an idle session does not pin 4 MiB.
"""

from __future__ import annotations

import struct

_OFFSET = struct.Struct(">Q")
INITIAL_BYTES = 64 * 1024


class OutputRing:
    """Holds stream bytes [start, end). `end` is the total written so far (plus the base)."""

    __slots__ = ("_buf", "capacity", "end", "start")

    def __init__(self, capacity: int, base: int = 0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._buf = bytearray(min(INITIAL_BYTES, capacity))
        self.start = base
        self.end = base

    def __len__(self) -> int:
        return self.end - self.start

    def holds(self, offset: int) -> bool:
        return self.start <= offset <= self.end

    def reset(self, offset: int) -> None:
        """Forget everything; the stream continues at `offset`."""
        self.start = self.end = offset

    def release(self) -> None:
        """Drop the buffer memory (the offsets stay)."""
        self._buf = bytearray(min(1024, self.capacity))
        self.start = self.end

    def _grow(self, want: int) -> None:
        size = min(self.capacity, max(want, 2 * len(self._buf)))
        held = self.read(self.start, self.end - self.start)
        self._buf = bytearray(size)
        self._place(self.start, held)

    def _place(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        size = len(self._buf)
        n = len(data)
        pos = offset % size
        first = min(n, size - pos)
        view = memoryview(data)
        self._buf[pos : pos + first] = view[:first]
        if first < n:
            self._buf[0 : n - first] = view[first:]

    def append(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if n == 0:
            return
        need = self.end + n - self.start
        if need > len(self._buf) and len(self._buf) < self.capacity:
            self._grow(need)
        size = len(self._buf)
        if n >= size:
            # Only the last `size` bytes survive.
            tail_offset = self.end + n - size
            self._place(tail_offset, memoryview(data)[n - size :])
            self.end += n
            self.start = self.end - size
            return
        self._place(self.end, data)
        self.end += n
        if self.end - self.start > size:
            self.start = self.end - size

    def _views(self, offset: int, n: int) -> tuple[memoryview, memoryview | None]:
        size = len(self._buf)
        pos = offset % size
        first = min(n, size - pos)
        mv = memoryview(self._buf)
        if first < n:
            return mv[pos : pos + first], mv[0 : n - first]
        return mv[pos : pos + n], None

    def read(self, offset: int, max_bytes: int) -> bytes:
        """Bytes from `offset` (which must be held), at most `max_bytes`."""
        if offset < self.start or offset > self.end:
            raise ValueError(f"offset {offset} not held (ring holds {self.start}..{self.end})")
        n = min(max_bytes, self.end - offset)
        if n <= 0:
            return b""
        a, b = self._views(offset, n)
        return bytes(a) if b is None else b"".join((a, b))

    def frame(self, offset: int, max_bytes: int) -> bytes:
        """A WebSocket output frame: 8-byte big-endian offset, then the bytes (one copy)."""
        if offset < self.start or offset > self.end:
            raise ValueError(f"offset {offset} not held (ring holds {self.start}..{self.end})")
        n = min(max_bytes, self.end - offset)
        a, b = self._views(offset, n)
        head = _OFFSET.pack(offset)
        return b"".join((head, a)) if b is None else b"".join((head, a, b))

    def tail(self, max_bytes: int) -> bytes:
        start = max(self.start, self.end - max_bytes)
        return self.read(start, self.end - start)


def pack_frame(offset: int, data: bytes) -> bytes:
    return _OFFSET.pack(offset) + data


def unpack_frame(frame: bytes) -> tuple[int, bytes]:
    if len(frame) < 8:
        raise ValueError("an output frame has at least 8 bytes (the offset)")
    return _OFFSET.unpack_from(frame)[0], frame[8:]
