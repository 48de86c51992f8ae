"""The refusal gate: refusals rate-limited per address before they are audited, and repeated
ones aggregated into one summary per window with a count that loses nothing."""

from __future__ import annotations

from typing import Any

from agentic_sandbox.broker.agentlink.service import peer_host
from agentic_sandbox.broker.auth.refusals import Refusal, RefusalGate


class FakeAudit:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def denied(self, actor: str, action: str, st: str, sid: str, cause: str) -> None:
        self.rows.append({"actor": actor, "action": action, "cause": cause, "detail": {}})

    def record(self, actor: str, action: str, st: str, sid: str, **kw: Any) -> None:
        self.rows.append({"actor": actor, "action": action, **kw})


class FakeEvents:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def publish(self, type: str, **kw: Any) -> None:
        self.events.append((type, kw.get("data") or {}))


def gate(**kw: Any) -> tuple[RefusalGate, FakeAudit, FakeEvents]:
    audit, events = FakeAudit(), FakeEvents()
    values = {"burst": 20, "per_minute": 20, "window_seconds": 60.0, **kw}
    return RefusalGate(audit, events, **values), audit, events  # type: ignore[arg-type]


def bad_token(addr: str = "10.0.0.1") -> Refusal:
    return Refusal(
        actor=f"anonymous@{addr}",
        action="GET /api/v2/admin/whoami",
        subject_type="route",
        subject_id="/api/v2/admin/whoami",
        reason="invalid, expired or revoked token",
        event="auth.denied",
    )


def total(audit: FakeAudit) -> int:
    return sum(int(r.get("detail", {}).get("count", 1)) for r in audit.rows)


def test_a_flood_is_two_rows_whose_counts_add_up() -> None:
    g, audit, events = gate()
    verdicts = [
        g.refuse("address:10.0.0.1", bad_token(), limit=True, now=i / 250) for i in range(1000)
    ]
    assert verdicts[0].recorded and not any(v.recorded for v in verdicts[1:])
    assert len(audit.rows) == 1 and len(events.events) == 1  # the first, at once
    g.flush(now=61.0)  # the window ends
    assert len(audit.rows) == 2 and len(events.events) == 2
    summary = audit.rows[1]
    assert summary["detail"]["count"] == 999 and summary["outcome"] == "denied"
    assert total(audit) == 1000
    assert events.events[1][1]["count"] == 999 and events.events[1][1]["aggregated"] is True


def test_past_the_burst_an_address_is_rate_limited_and_refills() -> None:
    g, _, _ = gate(burst=5, per_minute=60)
    verdicts = [g.refuse("address:a", bad_token("a"), limit=True, now=0.0) for _ in range(8)]
    assert [v.limited for v in verdicts] == [False] * 5 + [True] * 3
    assert 0.9 < verdicts[-1].retry_after <= 1.0
    assert not g.refuse("address:b", bad_token("b"), limit=True, now=0.0).limited  # per address
    assert not g.refuse("address:a", bad_token("a"), limit=True, now=1.01).limited  # refilled
    # A known caller's refusals (403s) are aggregated but never turned into 429s.
    assert not any(
        g.refuse("credential:x", bad_token(), limit=False, now=0.0).limited for _ in range(50)
    )


def test_each_kind_of_refusal_shows_at_once_and_windows_restart() -> None:
    g, audit, _ = gate(window_seconds=10.0)
    other = Refusal(**{**bad_token().__dict__, "reason": "no credentials"})
    assert g.refuse("address:a", bad_token("a"), limit=True, now=0.0).recorded
    assert g.refuse("address:a", other, limit=True, now=0.1).recorded  # another kind
    assert not g.refuse("address:a", bad_token("a"), limit=True, now=0.2).recorded
    # The next refusal after the window summarises the old one and starts a new window.
    assert g.refuse("address:a", bad_token("a"), limit=True, now=10.5).recorded
    assert [r["detail"].get("count", 1) for r in audit.rows] == [1, 1, 1, 1]
    assert audit.rows[2]["action"] == "auth.denied.repeated"
    assert total(audit) == 4


def test_tracked_windows_are_bounded_and_eviction_loses_no_count() -> None:
    g, audit, _ = gate(max_keys=100)
    for i in range(1000):
        for _ in range(3):
            g.refuse(f"address:{i}", bad_token(str(i)), limit=True, now=0.0)
    assert len(g._windows) <= 100
    g.flush()
    assert total(audit) == 3000


def test_grpc_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:127.0.0.1:54321") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:54321") == "::1"
    assert peer_host("unix:/run/x.sock") == "unix:/run/x.sock"
