"""Token buckets and the secret redactor."""

from __future__ import annotations

from agentic_sandbox.broker.auth.ratelimit import RateLimiter
from agentic_sandbox.broker.observability.logs import Redactor


def test_burst_then_refill() -> None:
    rl = RateLimiter(per_minute=60, burst=3)
    assert [rl.take("a", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = rl.take("a", now=0.0)
    assert 0.9 < wait <= 1.0
    assert rl.take("b", now=0.0) == 0.0  # buckets are per key
    assert rl.take("a", now=1.01) == 0.0  # one call per second refills


def test_redactor_masks_registered_values_only() -> None:
    r = Redactor()
    assert r.text("hunter22 is fine") == "hunter22 is fine"
    r.add(["hunter22", "abc"])  # too short values are not registered
    assert r.text("pw=hunter22; abc") == "pw=***; abc"
    assert r.data({"a": ["x hunter22 y"], "b": 3}) == {"a": ["x *** y"], "b": 3}
    r.remove(["hunter22"])
    assert r.text("hunter22") == "hunter22"
