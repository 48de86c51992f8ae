"""The fleet's event sink and crash-loop detection (hypervisor-neutral)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from .models import CrashRecord, FleetEvent

log = logging.getLogger(__name__)

EventCallback = Callable[[FleetEvent], None]


class CrashLoopDetector:
    """N crashes within a window means a crash loop: stop restarting it."""

    def __init__(self, threshold: int, window_s: float) -> None:
        self.threshold = threshold
        self.window = timedelta(seconds=window_s)

    def recent(self, crashes: Sequence[CrashRecord], now: datetime) -> list[CrashRecord]:
        return [c for c in crashes if now - c.at <= self.window]

    def is_loop(self, crashes: Sequence[CrashRecord], now: datetime) -> bool:
        return len(self.recent(crashes, now)) >= self.threshold


class EventSink:
    """Delivers events to the owner's callback; a failing callback never breaks the fleet."""

    def __init__(self, callback: EventCallback | None) -> None:
        self.callback = callback

    def emit(self, event: FleetEvent) -> None:
        log.debug("fleet event %s", event)
        if self.callback is None:
            return
        try:
            self.callback(event)
        except Exception:
            log.exception("fleet event callback failed for %s", event.kind)
