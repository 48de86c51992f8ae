"""A session's current screen, rendered by a server-side terminal emulator (pyte).

pyte is pure Python (well under 1 MB/s), so it is never on the output path: the screen is
brought up to date lazily — when a snapshot is needed (a new client, a resync, the screen API)
or when the session goes quiet. Close behind, it is fed the missing bytes; far behind (a
flood), it restarts from the last few KiB of the ring, starting at a line boundary: what is
on a terminal after a flood is its last lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyte
import pyte.graphics as g

from agentic_sandbox.broker.sessions.hitl import strip_ansi
from agentic_sandbox.broker.sessions.ring import OutputRing

INCREMENTAL_MAX = 32 * 1024  # feed at most this much to catch up; further behind: restart
RESTART_TAIL = 12 * 1024

_FG = {name: code for code, name in {**g.FG_ANSI, **g.FG_AIXTERM}.items()}
_BG = {name: code for code, name in {**g.BG_ANSI, **g.BG_AIXTERM}.items()}


def _color(value: str, table: dict[str, int], extended: int) -> str:
    if value == "default":
        return ""
    code = table.get(value)
    if code is not None:
        return str(code)
    if len(value) == 6:
        try:
            r, gr, b = int(value[0:2], 16), int(value[2:4], 16), int(value[4:6], 16)
        except ValueError:
            return ""
        return f"{extended};2;{r};{gr};{b}"
    return ""


def _sgr(ch: Any) -> str:
    parts = ["0"]
    if ch.bold:
        parts.append("1")
    if ch.italics:
        parts.append("3")
    if ch.underscore:
        parts.append("4")
    if ch.blink:
        parts.append("5")
    if ch.reverse:
        parts.append("7")
    if ch.strikethrough:
        parts.append("9")
    fg = _color(ch.fg, _FG, 38)
    if fg:
        parts.append(fg)
    bg = _color(ch.bg, _BG, 48)
    if bg:
        parts.append(bg)
    return "\x1b[" + ";".join(parts) + "m"


@dataclass(frozen=True)
class Snapshot:
    offset: int  # the output offset the screen reflects
    cols: int
    rows: int
    ansi: str  # repaints the screen on a reset terminal


class ScreenTracker:
    def __init__(self, cols: int, rows: int) -> None:
        self.cols = cols
        self.rows = rows
        self.offset = -1  # output offset fed so far (-1: nothing yet)
        self._new_screen()
        self._snapshot: Snapshot | None = None

    def _new_screen(self) -> None:
        self.screen = pyte.Screen(self.cols, self.rows)
        self.stream = pyte.ByteStream(self.screen)

    def resize(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        self.screen.resize(rows, cols)
        self._snapshot = None

    def catch_up(self, ring: OutputRing) -> None:
        """Feed the screen up to `ring.end` (bounded work, see the module note)."""
        if self.offset == ring.end:
            return
        self._snapshot = None
        behind = ring.end - self.offset
        if self.offset < ring.start or self.offset < 0 or behind > INCREMENTAL_MAX:
            self._new_screen()
            start = max(ring.start, ring.end - RESTART_TAIL)
            data = ring.read(start, ring.end - start)
            if start > ring.start:
                cut = data.find(b"\n")
                if 0 <= cut < len(data) - 1:
                    data = data[cut + 1 :]
            self.stream.feed(data)
        else:
            self.stream.feed(ring.read(self.offset, behind))
        self.offset = ring.end

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def cursor(self) -> dict[str, Any]:
        c = self.screen.cursor
        return {"x": c.x, "y": c.y, "hidden": bool(c.hidden)}

    def snapshot(self, ring: OutputRing) -> Snapshot:
        self.catch_up(ring)
        if self._snapshot is not None and self._snapshot.offset == ring.end:
            return self._snapshot
        out = ["\x1b[0m\x1b[H\x1b[2J"]
        buffer = self.screen.buffer
        default = self.screen.default_char
        for y in range(self.rows):
            row = buffer[y]
            # last non-blank cell of the row
            last = -1
            for x in sorted(row.keys(), reverse=True):
                ch = row[x]
                if x < self.cols and (ch.data not in (" ", "") or ch != default):
                    last = x
                    break
            if last < 0:
                continue
            out.append(f"\x1b[{y + 1};1H")
            current = ""
            for x in range(last + 1):
                ch = row[x]
                sgr = _sgr(ch)
                if sgr != current:
                    out.append(sgr)
                    current = sgr
                out.append(ch.data or " ")
            out.append("\x1b[0m")
        c = self.screen.cursor
        out.append(f"\x1b[{c.y + 1};{c.x + 1}H")
        out.append("\x1b[?25l" if c.hidden else "\x1b[?25h")
        self._snapshot = Snapshot(ring.end, self.cols, self.rows, "".join(out))
        return self._snapshot


def scrollback_tail(ring: OutputRing, rows: int, count: int) -> list[str]:
    """About `count` lines of text that scrolled off above the screen (from the ring's tail)."""
    if count <= 0:
        return []
    text = strip_ansi(ring.tail(64 * 1024))
    lines = [
        ln.rsplit("\r", 1)[-1] if "\r" in ln.rstrip("\r") else ln.rstrip("\r")
        for ln in text.split("\n")
    ]
    above = lines[:-rows] if len(lines) > rows else []
    return [ln.rstrip() for ln in above[-count:]]
