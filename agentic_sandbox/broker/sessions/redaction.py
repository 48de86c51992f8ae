"""Redaction of an instance's secrets from a session's output stream.

Every occurrence of a registered value (at least 4 bytes) is replaced by `*` of the same length,
so stream offsets stay the same for everyone (agent, ring, clients, recordings). A value split
across two output chunks is caught by holding back a chunk's tail while it could be the start of
a secret; the hub flushes a held tail after a short quiet time, so nothing is delayed for long
and an echo is never held unless it looks like the start of a secret.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MIN_SECRET_BYTES = 4
MASK_BYTE = b"*"


class StreamRedactor:
    __slots__ = ("_held", "_pattern", "_values")

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: list[bytes] = []
        self._pattern: re.Pattern[bytes] | None = None
        self._held = b""
        self.set(values)

    @property
    def active(self) -> bool:
        return self._pattern is not None or bool(self._held)

    @property
    def held(self) -> int:
        return len(self._held)

    def set(self, values: Iterable[str]) -> None:
        encoded = {v.encode() for v in values if len(v.encode()) >= MIN_SECRET_BYTES}
        self._values = sorted(encoded, key=len, reverse=True)
        self._pattern = (
            re.compile(b"|".join(re.escape(v) for v in self._values)) if self._values else None
        )

    @staticmethod
    def _mask(match: re.Match[bytes]) -> bytes:
        return MASK_BYTE * (match.end() - match.start())

    def _partial(self, buf: bytes) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some secret."""
        best = 0
        for value in self._values:
            for k in range(min(len(value) - 1, len(buf)), best, -1):
                if buf.endswith(value[:k]):
                    best = k
                    break
        return best

    def feed(self, data: bytes) -> bytes:
        """Redacted bytes ready to emit now (the rest is held back until the next call)."""
        if self._pattern is None:
            if not self._held:
                return data
            data, self._held = self._held + data, b""
            return data
        buf = self._held + data if self._held else data
        self._held = b""
        buf = self._pattern.sub(self._mask, buf)
        hold = self._partial(buf)
        if hold:
            self._held = buf[-hold:]
            buf = buf[:-hold]
        return buf

    def flush(self) -> bytes:
        """Release a held tail (the output went quiet, so it was not a secret after all)."""
        held, self._held = self._held, b""
        return held

    def drop_held(self) -> int:
        """Forget a held tail (its bytes will be sent again by the agent); returns its length."""
        n = len(self._held)
        self._held = b""
        return n
