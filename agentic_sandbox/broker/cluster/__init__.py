"""Several control hosts on one PostgreSQL: who leads, and the fence on the leader's writes.

`leadership_for(settings, db)` gives `SingleNode` on SQLite (one server per data dir, always
leader, refused twice by `server.lock`) and `Elector` on PostgreSQL (an advisory lock elects,
`control_term` fences; see `leadership.py`). The server starts its leader-only components once
`elected()` returns and steps down (exit 75) when `on_lost` fires.
"""

from __future__ import annotations

from agentic_sandbox.broker.cluster.leadership import ELECTION_KEY, Elector
from agentic_sandbox.broker.cluster.single import DataDirBusy, DataDirLock, SingleNode
from agentic_sandbox.broker.cluster.state import (
    LeaderInfo,
    Leadership,
    NodeInfo,
    Role,
    interruption,
)
from agentic_sandbox.broker.cluster.tail import EventTail
from agentic_sandbox.broker.store import Fenced

__all__ = [
    "ELECTION_KEY",
    "DataDirBusy",
    "DataDirLock",
    "Elector",
    "EventTail",
    "Fenced",
    "LeaderInfo",
    "Leadership",
    "NodeInfo",
    "Role",
    "SingleNode",
    "interruption",
]
