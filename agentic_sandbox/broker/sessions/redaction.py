"""Redaction of an instance's secrets from a session's output stream.

Every occurrence of a registered value (at least 4 bytes) is replaced by `*` of the same
length, so stream offsets stay the same for everyone (agent, ring, clients, recordings, task
artifacts).

The matcher is stateful across writes, whatever their size and timing: output is held back
while it could still be the start of a secret (a proper prefix of one runs to the end of what
has arrived), and released only when what follows decides it — either the secret is complete
(masked) or the partial match fails (released as it is). No timer releases held bytes: printing
a secret one character at a time, with any pauses, leaks nothing. What may be held is bounded
by the longest secret (less one byte).

The result does not depend on how the stream is cut into writes: it is exactly what
`pattern.sub` (leftmost match first, the longest secret at a position first, no overlaps) gives
for the whole stream at once. A position is decided once no secret could still start there
with more output; decided positions are masked or released, the rest is held.

When the stream ends (the session exits) or breaks (a gap: the agent's ring lost output) while
bytes are held, those bytes are masked: they are the start of a secret the stream never
finished, and releasing them would show all of it but its end. The cost is a few trailing `*`
when output ends with what merely looks like the start of a secret. When the link drops, held
bytes are forgotten instead (`drop_held`): the agent sends them again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MIN_SECRET_BYTES = 4
MASK_BYTE = b"*"
HEAD_BYTES = 8  # a secret's first bytes, to find where a long partial match may begin


class StreamRedactor:
    __slots__ = ("_heads", "_held", "_longest", "_pattern", "_short_any", "_shorts", "_values")

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: list[tuple[int, memoryview]] = []
        self._pattern: re.Pattern[bytes] | None = None
        self._heads: re.Pattern[bytes] | None = None
        self._shorts: list[tuple[int, tuple[bytes, ...]]] = []
        self._short_any: tuple[bytes, ...] = ()
        self._longest = 0
        self._held = b""
        self.set(values)

    @property
    def active(self) -> bool:
        return self._pattern is not None or bool(self._held)

    @property
    def held(self) -> int:
        return len(self._held)

    def set(self, values: Iterable[str]) -> None:
        """The secrets to redact from now on. Bytes already held stay held until the next
        `feed` (`feed(b"")` re-decides them at once)."""
        encoded = sorted(
            {v.encode() for v in values if len(v.encode()) >= MIN_SECRET_BYTES},
            key=len,
            reverse=True,
        )
        self._values = [(len(v), memoryview(v)) for v in encoded]
        if not encoded:
            self._pattern = self._heads = None
            self._shorts, self._short_any, self._longest = [], (), 0
            return
        # Longest first: at a position, the longest secret that matches there wins.
        self._pattern = re.compile(b"|".join(re.escape(v) for v in encoded))
        self._longest = len(encoded[0])
        # A partial match of k bytes: k < head length is found by `endswith` (one call for all
        # secrets); a longer one begins where a secret's head is, found by one regex scan.
        heads = {v[: min(HEAD_BYTES, len(v) - 1)] for v in encoded}
        self._heads = re.compile(
            b"(?=" + b"|".join(re.escape(h) for h in sorted(heads, key=len, reverse=True)) + b")"
        )
        by_len: dict[int, set[bytes]] = {}
        for v in encoded:
            for k in range(1, min(HEAD_BYTES, len(v) - 1)):
                by_len.setdefault(k, set()).add(v[:k])
        self._shorts = [(k, tuple(by_len[k])) for k in sorted(by_len, reverse=True)]
        self._short_any = tuple(p for _, group in self._shorts for p in group)

    @staticmethod
    def _mask(match: re.Match[bytes]) -> bytes:
        return MASK_BYTE * (match.end() - match.start())

    def _hold_from(self, buf: bytes, start: int) -> int:
        """Where the longest tail of `buf[start:]` that is a proper prefix of a secret begins
        (`len(buf)` when there is none): from there on nothing is decided yet."""
        n = len(buf)
        lo = max(start, n - self._longest + 1)
        if lo >= n:
            return n
        best = n
        if buf.endswith(self._short_any, lo):
            for k, group in self._shorts:  # longest first
                if n - k >= lo and buf.endswith(group):
                    best = n - k
                    break
        assert self._heads is not None
        view: memoryview | None = None
        for m in self._heads.finditer(buf, lo):  # (no endpos: the lookahead must see on)
            q = m.start()
            if q >= best:
                break
            tail_len = n - q
            if view is None:
                view = memoryview(buf)
            tail = view[q:]
            for length, value in self._values:  # longest first
                if length <= tail_len:
                    break  # this one and the rest are too short to have it as a proper prefix
                if value[:tail_len] == tail:
                    return q
        return best

    def feed(self, data: bytes) -> bytes:
        """The redacted bytes that are decided now; the rest is held until a later call."""
        if self._pattern is None:
            if not self._held:
                return data
            data, self._held = self._held + data, b""
            return data
        buf = self._held + data if self._held else data
        hold = self._hold_from(buf, 0)
        if hold == len(buf):  # the usual case: all of it is decided, one C-level pass
            self._held = b""
            return self._pattern.sub(self._mask, buf)
        pieces: list[bytes] = []
        done = 0
        for m in self._pattern.finditer(buf):
            begin, end = m.span()
            if begin >= hold:
                break  # not decided: a longer secret may still start here
            pieces.append(buf[done:begin])
            pieces.append(MASK_BYTE * (end - begin))
            done = end
            if end > hold:  # the match ran over the undecided tail: decide again after it
                hold = self._hold_from(buf, end)
        self._held = buf[hold:] if hold < len(buf) else b""
        if not pieces:
            return buf[:hold]
        if done < hold:
            pieces.append(buf[done:hold])
        return b"".join(pieces)

    def mask_held(self) -> bytes:
        """The stream ends or breaks here: the held bytes, masked (they began a secret the
        stream never finished)."""
        n = len(self._held)
        self._held = b""
        return MASK_BYTE * n

    def drop_held(self) -> int:
        """Forget the held bytes (the agent will send them again); returns their length."""
        n = len(self._held)
        self._held = b""
        return n
