"""The hub's session table: per-instance questions cost what the instance holds, not the hub.

Ended sessions stay in the table for `session_retain_seconds` (300 s by default), so under load a
table holds rate x 300 s of them; a create asks `live_count` of its instance every time.
"""

from __future__ import annotations

import datetime as dt

from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions.ring import OutputRing
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.broker.sessions.states import ENDED, SessionState
from agentic_sandbox.broker.sessions.table import SessionTable


class CountedSession(HubSession):
    """A session that counts how often its state is asked whether it ended."""

    reads = 0

    @property
    def ended(self) -> bool:
        CountedSession.reads += 1
        return self.state in ENDED


def session(sid: str, instance_id: str, state: SessionState = SessionState.running) -> HubSession:
    return CountedSession(
        id=sid,
        instance_id=instance_id,
        owner="alice",
        name=sid,
        command=None,
        cols=80,
        rows=24,
        created_at=dt.datetime.now(dt.UTC),
        ring=OutputRing(64),
        state=state,
    )


def test_live_count_and_of_instance_follow_adds_ends_and_removes() -> None:
    table = SessionTable(Metrics())
    a1, a2, b1 = session("a1", "A"), session("a2", "A"), session("b1", "B")
    for sess in (a1, a2, b1):
        table.add(sess)
    assert table.live_count("A") == 2 and table.live_count("B") == 1
    assert table.live_count("nobody") == 0
    a1.state = SessionState.exited
    assert table.live_count("A") == 1
    assert {s.id for s in table.of_instance("A")} == {"a1", "a2"}  # ended ones are still held
    assert sorted(table.live_instances()) == ["A", "B"]
    table.remove(a2)
    assert table.live_count("A") == 0
    assert table.live_instances() == ["B"]
    assert [s.id for s in table.of_instance("A")] == ["a1"]
    table.remove(a1)
    assert table.of_instance("A") == [] and "a1" not in table and len(table) == 1
    table.remove(a1)  # a second remove is a no-op
    assert len(table) == 1


def test_a_session_added_again_under_its_id_replaces_the_old_one_everywhere() -> None:
    table = SessionTable(Metrics())
    old, new = session("s", "A"), session("s", "A")
    table.add(old)
    table.add(new)
    assert table.of_instance("A") == [new] and table.live_count("A") == 1
    table.remove(old)  # no longer held: nothing happens
    assert table.get("s") is new


def test_counting_live_sessions_does_not_revisit_retained_ended_ones() -> None:
    table = SessionTable(Metrics())
    for i in range(2000):
        table.add(session(f"old{i}", "A", SessionState.exited))
    for i in range(3000):
        table.add(session(f"other{i}", "B"))
    for i in range(2000, 2500):
        sess = session(f"done{i}", "A")
        table.add(sess)
        sess.state = SessionState.exited  # ended after it was added
    table.add(session("now", "A"))
    assert table.live_count("A") == 1
    CountedSession.reads = 0
    for _ in range(100):
        assert table.live_count("A") == 1
    # one look at the one live session per count: not the 2500 retained, not instance B's
    assert CountedSession.reads == 100
