"""The agent's per-session output ring: the last N bytes of a PTY's output, by stream offset.

The agent may only overwrite bytes the server has acknowledged; the session's reader stops
reading the PTY when the unacknowledged backlog would not fit (flow control). Appends and
reads are slice copies; nothing walks the data byte by byte.

A shared ring (`Ring.shared`, sessions under the keeper) lives in a memfd: a 16-byte header
(`start`, `end`), then the data. Its pages outlive the worker process (the keeper holds a copy
of the descriptor), so a new worker takes the ring on (`Ring.attach`) with every byte the old
one had read from the PTY: the header is written after the data it covers. Its memory is
committed page by page as output arrives, as the private ring grows.
"""

from __future__ import annotations

import mmap
import os
import struct

INITIAL_BYTES = 64 * 1024
HEADER = struct.Struct("<QQ")
DATA_AT = 4096  # the data starts on the second page


class Ring:
    __slots__ = ("_buf", "_map", "capacity", "end", "fd", "start")

    def __init__(self, capacity: int) -> None:
        if capacity < 4096:
            raise ValueError("ring capacity must be at least 4096 bytes")
        self.capacity = capacity
        self._buf: bytearray | memoryview = bytearray(min(INITIAL_BYTES, capacity))
        self._map: mmap.mmap | None = None
        self.fd: int | None = None  # a shared ring's memfd
        self.start = 0
        self.end = 0

    @classmethod
    def shared(cls, capacity: int, name: str = "ring") -> Ring:
        """A ring in a memfd of its own (see the module note)."""
        ring = cls(capacity)
        fd = os.memfd_create(f"agent-{name}"[:200], os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, DATA_AT + capacity)
            ring._attach(fd, 0, 0)
        except BaseException:
            os.close(fd)
            raise
        return ring

    @classmethod
    def attach(cls, fd: int) -> Ring:
        """Take on a shared ring another process filled (its descriptor is now this ring's)."""
        size = os.fstat(fd).st_size
        if size < DATA_AT + 4096:
            raise ValueError(f"not a ring: {size} bytes")
        ring = cls(size - DATA_AT)
        with mmap.mmap(fd, DATA_AT, prot=mmap.PROT_READ) as head:
            start, end = HEADER.unpack_from(head, 0)
        if not 0 <= end - start <= ring.capacity:
            raise ValueError(f"a ring header out of bounds: {start}..{end}")
        ring._attach(fd, start, end)
        return ring

    def _attach(self, fd: int, start: int, end: int) -> None:
        self._map = mmap.mmap(fd, DATA_AT + self.capacity)
        self._buf = memoryview(self._map)[DATA_AT:]
        self.fd = fd
        self.start, self.end = start, end
        HEADER.pack_into(self._map, 0, start, end)

    def close(self) -> None:
        """Release a shared ring's mapping and descriptor (what it held is gone)."""
        if self._map is not None:
            if isinstance(self._buf, memoryview):
                self._buf.release()
            self._buf = bytearray(0)
            self._map.close()
            self._map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

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
        if self._map is not None:
            HEADER.pack_into(self._map, 0, self.start, self.end)

    def read_from(self, fd: int, max_bytes: int) -> int:
        """Read up to `max_bytes` of `fd` after `end` (0: end of file). A shared ring reads
        straight into its pages (one `readv`, no copy) and covers the bytes in its header at
        once, so a worker killed right after the read leaves them to the next one."""
        if self._map is None:
            data = os.read(fd, max_bytes)
            self.append(data)
            return len(data)
        size = self.capacity
        pos = self.end % size
        first = min(max_bytes, size - pos)
        bufs = [self._buf[pos : pos + first]]
        if first < max_bytes:
            bufs.append(self._buf[0 : max_bytes - first])
        n = os.readv(fd, bufs)
        if n:
            self.end += n
            if self.end - self.start > size:
                self.start = self.end - size
            HEADER.pack_into(self._map, 0, self.start, self.end)
        return n

    def drop_tail(self, n: int) -> None:
        """Forget the newest `n` bytes (output over a session's budget)."""
        self.end -= min(n, self.end - self.start)
        if self._map is not None:
            HEADER.pack_into(self._map, 0, self.start, self.end)

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
