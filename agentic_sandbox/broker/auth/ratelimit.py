"""Per-credential token buckets (calls per minute plus a burst)."""

from __future__ import annotations

import time
from collections import OrderedDict


class RateLimiter:
    def __init__(self, per_minute: int, burst: int, max_keys: int = 50_000) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._max_keys = max_keys

    def take(self, key: str, now: float | None = None) -> float:
        """Spend one call. Returns 0 when allowed, else seconds until the next call fits."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._buckets[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return wait
