"""Lifecycle event mapping, crash-loop detection, port allocation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import libvirt
import pytest

from agentic_sandbox.fleet import InstanceState, NoCapacity
from agentic_sandbox.fleet.events import CrashLoopDetector, EventSink
from agentic_sandbox.fleet.libvirt.events import state_from_domain, state_from_event
from agentic_sandbox.fleet.models import CrashRecord, FleetEvent, FleetEventKind
from agentic_sandbox.fleet.ports import PortAllocator

E = libvirt


@pytest.mark.parametrize(
    "event,detail,state,crashed",
    [
        (E.VIR_DOMAIN_EVENT_STARTED, 0, InstanceState.RUNNING, False),
        (E.VIR_DOMAIN_EVENT_SUSPENDED, 0, InstanceState.PAUSED, False),
        (E.VIR_DOMAIN_EVENT_RESUMED, 0, InstanceState.RUNNING, False),
        (
            E.VIR_DOMAIN_EVENT_STOPPED,
            E.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN,
            InstanceState.SHUTOFF,
            False,
        ),
        (
            E.VIR_DOMAIN_EVENT_STOPPED,
            E.VIR_DOMAIN_EVENT_STOPPED_DESTROYED,
            InstanceState.SHUTOFF,
            False,
        ),
        (
            E.VIR_DOMAIN_EVENT_STOPPED,
            E.VIR_DOMAIN_EVENT_STOPPED_FAILED,
            InstanceState.CRASHED,
            True,
        ),
        (
            E.VIR_DOMAIN_EVENT_STOPPED,
            E.VIR_DOMAIN_EVENT_STOPPED_CRASHED,
            InstanceState.CRASHED,
            True,
        ),
        (E.VIR_DOMAIN_EVENT_DEFINED, 0, None, False),
    ],
)
def test_event_mapping(event: int, detail: int, state: InstanceState | None, crashed: bool) -> None:
    got, was_crash, _why = state_from_event(event, detail)
    assert got == state and was_crash == crashed


def test_domain_state_mapping() -> None:
    assert state_from_domain(E.VIR_DOMAIN_RUNNING, 0) is InstanceState.RUNNING
    assert (
        state_from_domain(E.VIR_DOMAIN_SHUTOFF, E.VIR_DOMAIN_SHUTOFF_SHUTDOWN)
        is InstanceState.SHUTOFF
    )
    assert (
        state_from_domain(E.VIR_DOMAIN_SHUTOFF, E.VIR_DOMAIN_SHUTOFF_CRASHED)
        is InstanceState.CRASHED
    )
    assert state_from_domain(E.VIR_DOMAIN_PAUSED, 0) is InstanceState.PAUSED


def test_crash_loop_window() -> None:
    d = CrashLoopDetector(threshold=3, window_s=60)
    now = datetime.now(UTC)
    old = CrashRecord(at=now - timedelta(seconds=120))
    recent = [CrashRecord(at=now - timedelta(seconds=s)) for s in (1, 2)]
    assert not d.is_loop([old, *recent], now)
    assert d.is_loop([old, *recent, CrashRecord(at=now)], now)


def test_event_sink_survives_callback_errors() -> None:
    def boom(_e: FleetEvent) -> None:
        raise RuntimeError("x")

    EventSink(boom).emit(FleetEvent(kind=FleetEventKind.HOST_ADDED))


def test_ports() -> None:
    p = PortAllocator(50000, 50002, probe_local=False)
    got = [p.allocate(), p.allocate(), p.allocate()]
    assert sorted(got) == [50000, 50001, 50002]
    with pytest.raises(NoCapacity):
        p.allocate()
    p.release(50001)
    assert p.allocate() == 50001
    p.release(50000)
    p.claim(50000)
    with pytest.raises(NoCapacity):
        p.allocate()


def test_ports_skip_busy_local_port() -> None:
    import socket

    # the port after ours may be taken by another process on a shared machine: the range
    # reaches up to 64 ports past it, and only ours is known busy
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        high = min(busy + 64, 65535)
        p = PortAllocator(busy, high, probe_local=True)
        got = p.allocate()
        assert busy < got <= high
