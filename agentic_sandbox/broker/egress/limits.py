"""Per-instance limits: connections at once (over it: refused at once, with a reason) and
bandwidth (a token bucket each way, shared by the instance's connections; a connection over
it is slowed to the rate, never stalled beyond what the rate implies)."""

from __future__ import annotations

import asyncio
import time


class Bucket:
    """A token bucket of `rate` bytes per second with one second of burst."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._tokens = float(rate)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        if self.rate <= 0 or n <= 0:
            return
        async with self._lock:  # one waiter at a time keeps the order fair
            now = time.monotonic()
            self._tokens = min(float(self.rate), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)


class InstanceLimits:
    """The live counters of one instance (its incarnation)."""

    def __init__(self, max_connections: int, rate: int) -> None:
        self.max_connections = max_connections
        self.active = 0
        self.up = Bucket(rate)
        self.down = Bucket(rate)

    def configure(self, max_connections: int, rate: int) -> None:
        self.max_connections = max_connections
        if rate != self.up.rate:
            self.up = Bucket(rate)
            self.down = Bucket(rate)

    def try_acquire(self) -> bool:
        if self.active >= self.max_connections:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active = max(0, self.active - 1)
