"""libvirt's domain states and lifecycle events in the fleet's terms (`driver.DomainStatus`,
`driver.DomainEvent`)."""

from __future__ import annotations

import libvirt

from ..driver import DomainEvent, DomainEventKind, DomainStatus, PowerState
from ..models import InstanceState

_E = libvirt
_STOPPED_CRASH = {_E.VIR_DOMAIN_EVENT_STOPPED_CRASHED, _E.VIR_DOMAIN_EVENT_STOPPED_FAILED}
_POWER = {
    _E.VIR_DOMAIN_NOSTATE: PowerState.NO_STATE,
    _E.VIR_DOMAIN_RUNNING: PowerState.RUNNING,
    _E.VIR_DOMAIN_BLOCKED: PowerState.BLOCKED,
    _E.VIR_DOMAIN_PAUSED: PowerState.PAUSED,
    _E.VIR_DOMAIN_SHUTDOWN: PowerState.SHUTTING_DOWN,
    _E.VIR_DOMAIN_SHUTOFF: PowerState.SHUTOFF,
    _E.VIR_DOMAIN_CRASHED: PowerState.CRASHED,
    _E.VIR_DOMAIN_PMSUSPENDED: PowerState.PM_SUSPENDED,
}


def domain_status(state: int, reason: int) -> DomainStatus:
    """``virDomainGetState`` (state, reason) -> status."""
    failed = state == _E.VIR_DOMAIN_SHUTOFF and reason in (
        _E.VIR_DOMAIN_SHUTOFF_CRASHED,
        _E.VIR_DOMAIN_SHUTOFF_FAILED,
    )
    return DomainStatus(_POWER.get(state, PowerState.NO_STATE), failed)


def state_from_domain(state: int, reason: int) -> InstanceState:
    return domain_status(state, reason).state


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


def domain_event(name: str, uuid: str, event: int, detail: int) -> DomainEvent:
    if event == _E.VIR_DOMAIN_EVENT_DEFINED:
        kind = DomainEventKind.DEFINED
    elif event == _E.VIR_DOMAIN_EVENT_UNDEFINED:
        kind = DomainEventKind.UNDEFINED
    else:
        kind = DomainEventKind.CHANGED
    state, crashed, why = state_from_event(event, detail)
    return DomainEvent(name, uuid, kind, state, crashed, why)
