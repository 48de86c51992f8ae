"""Lifecycle events: libvirt's events mapped to instance states, crash loops, the event sink."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import libvirt

from .models import CrashRecord, FleetEvent, InstanceState

log = logging.getLogger(__name__)

EventCallback = Callable[[FleetEvent], None]

_E = libvirt
_STOPPED_CRASH = {_E.VIR_DOMAIN_EVENT_STOPPED_CRASHED, _E.VIR_DOMAIN_EVENT_STOPPED_FAILED}


def state_from_libvirt(state: int) -> InstanceState:
    """``virDomainGetState`` -> instance state."""
    return {
        _E.VIR_DOMAIN_NOSTATE: InstanceState.UNKNOWN,
        _E.VIR_DOMAIN_RUNNING: InstanceState.RUNNING,
        _E.VIR_DOMAIN_BLOCKED: InstanceState.RUNNING,
        _E.VIR_DOMAIN_PAUSED: InstanceState.PAUSED,
        _E.VIR_DOMAIN_SHUTDOWN: InstanceState.RUNNING,  # shutting down, still running
        _E.VIR_DOMAIN_SHUTOFF: InstanceState.SHUTOFF,
        _E.VIR_DOMAIN_CRASHED: InstanceState.CRASHED,
        _E.VIR_DOMAIN_PMSUSPENDED: InstanceState.PAUSED,
    }.get(state, InstanceState.UNKNOWN)


def state_from_domain(state: int, reason: int) -> InstanceState:
    if state == _E.VIR_DOMAIN_SHUTOFF and reason in (
        _E.VIR_DOMAIN_SHUTOFF_CRASHED,
        _E.VIR_DOMAIN_SHUTOFF_FAILED,
    ):
        return InstanceState.CRASHED
    return state_from_libvirt(state)


def state_from_event(event: int, detail: int) -> tuple[InstanceState | None, bool, str]:
    """A lifecycle event -> (new state or None if it does not change the state, crashed?, why)."""
    if event == _E.VIR_DOMAIN_EVENT_STARTED:
        return InstanceState.RUNNING, False, "started"
    if event == _E.VIR_DOMAIN_EVENT_RESUMED:
        return InstanceState.RUNNING, False, "resumed"
    if event == _E.VIR_DOMAIN_EVENT_SUSPENDED:
        return InstanceState.PAUSED, False, "suspended"
    if event == _E.VIR_DOMAIN_EVENT_PMSUSPENDED:
        return InstanceState.PAUSED, False, "guest suspended itself"
    if event == _E.VIR_DOMAIN_EVENT_STOPPED:
        if detail in _STOPPED_CRASH:
            why = (
                "guest crashed"
                if detail == _E.VIR_DOMAIN_EVENT_STOPPED_CRASHED
                else "QEMU failed/died"
            )
            return InstanceState.CRASHED, True, why
        why = {
            _E.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN: "guest shut down",
            _E.VIR_DOMAIN_EVENT_STOPPED_DESTROYED: "powered off",
            _E.VIR_DOMAIN_EVENT_STOPPED_SAVED: "saved",
            _E.VIR_DOMAIN_EVENT_STOPPED_FROM_SNAPSHOT: "reverted to a stopped snapshot",
        }.get(detail, "stopped")
        return InstanceState.SHUTOFF, False, why
    if event == _E.VIR_DOMAIN_EVENT_CRASHED:
        return None, False, "guest panicked"
    return None, False, ""


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
