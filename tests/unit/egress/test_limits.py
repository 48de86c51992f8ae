"""Per-instance limits: the connection count and the bandwidth buckets (on a fake clock:
what a connection over the rate waits is the deficit over the rate, never more)."""

from __future__ import annotations

import pytest

from agentic_sandbox.broker.egress import limits
from agentic_sandbox.broker.egress.limits import Bucket, InstanceLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(limits.time, "monotonic", c.monotonic)
    monkeypatch.setattr(limits.asyncio, "sleep", c.sleep)
    return c


async def test_a_bucket_lets_a_second_of_burst_through_then_paces(clock: Clock) -> None:
    bucket = Bucket(1000)
    await bucket.take(1000)
    assert clock.slept == []
    await bucket.take(500)
    assert clock.slept == [pytest.approx(0.5)]
    clock.now += 10  # idle: the bucket refills to one second's worth, no more
    await bucket.take(1000)
    await bucket.take(250)
    assert clock.slept[1:] == [pytest.approx(0.25)]


async def test_no_rate_means_no_wait(clock: Clock) -> None:
    bucket = Bucket(0)
    for _ in range(10):
        await bucket.take(1 << 30)
    assert clock.slept == []


def test_connections_are_counted_and_the_limit_can_change() -> None:
    lim = InstanceLimits(2, 0)
    assert lim.try_acquire() and lim.try_acquire()
    assert not lim.try_acquire()
    lim.release()
    assert lim.try_acquire()
    lim.configure(3, 0)
    assert lim.try_acquire() and not lim.try_acquire()
    lim.configure(3, 5000)
    assert lim.up.rate == lim.down.rate == 5000
