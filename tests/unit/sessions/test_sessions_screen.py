"""The lazy server-side screen: snapshots that repaint the same screen, bounded catch-up."""

from __future__ import annotations

import pyte

from agentic_sandbox.broker.sessions.ring import OutputRing
from agentic_sandbox.broker.sessions.screen import RESTART_TAIL, ScreenTracker, scrollback_tail


def _replay(ansi: str, cols: int, rows: int) -> pyte.Screen:
    screen = pyte.Screen(cols, rows)
    pyte.Stream(screen).feed(ansi)
    return screen


def test_snapshot_repaints_text_colours_and_cursor() -> None:
    ring = OutputRing(1 << 20)
    ring.append(b"plain line\r\n\x1b[1;31mbold red\x1b[0m and \x1b[44mblue bg\x1b[0m\r\n> ")
    tracker = ScreenTracker(40, 10)
    snap = tracker.snapshot(ring)
    assert snap.offset == ring.end
    again = _replay(snap.ansi, 40, 10)
    assert again.display == tracker.screen.display
    assert (again.cursor.x, again.cursor.y) == (2, 2)
    assert again.buffer[1][0].fg == "red" and again.buffer[1][0].bold
    assert again.buffer[1][13].bg == "blue"
    assert tracker.snapshot(ring) is snap  # cached while nothing changes


def test_catch_up_is_bounded_after_a_flood() -> None:
    ring = OutputRing(4 << 20)
    tracker = ScreenTracker(80, 24)
    tracker.snapshot(ring)
    flood = b"".join(b"line %d\r\n" % i for i in range(200_000))
    ring.append(flood)
    tracker.catch_up(ring)  # restarts from the tail instead of feeding megabytes
    assert tracker.offset == ring.end
    lines = tracker.lines()
    assert lines[-2] == "line 199999"
    assert len(flood) > RESTART_TAIL


def test_resize_and_scrollback_tail() -> None:
    ring = OutputRing(1 << 20)
    ring.append(b"".join(b"row %d\r\n" % i for i in range(100)))
    tracker = ScreenTracker(80, 24)
    tracker.catch_up(ring)
    tracker.resize(100, 10)
    assert (tracker.cols, tracker.rows) == (100, 10)
    tail = scrollback_tail(ring, 24, 5)
    assert tail == [f"row {i}" for i in range(72, 77)]
