"""Nothing an agent reports about sessions is trusted.

- A session is an agent's when it is of the agent's instance *and* incarnation (`belongs`): a
  session of an earlier instance with the same id is never a new agent's.
- A session id an agent sends must be a canonical UUID (`ids.is_session_id`) before it is looked
  up, stored, echoed back or made into a file name; the table is looked up only through
  `AgentTrust.mine`.
- Offsets, sizes and exit strings are bounded (`MAX_OFFSET`, `bounded_size`, `exit_status`);
  a budget reason is one of the four names, or dropped.
- A report that is refused is dropped: counted always (`sandbox_agent_refusals_total{reason}`),
  logged for the first few of each link (the id cut and quoted).
"""

from __future__ import annotations

import logging
import re
from collections import Counter

from prometheus_client import Counter as MetricCounter

from agentic_sandbox.broker.agentlink import AgentConnection, ExitReport, Inventory
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.contract import MAX_EXIT_LISTING, ExitStatus, RunUsage
from agentic_sandbox.broker.sessions.ids import is_session_id, shown
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.broker.sessions.table import SessionTable

log = logging.getLogger(__name__)

# Output offsets an agent may report: what a JavaScript client still holds exactly, far beyond
# any real session, and within the database's signed 64-bit column.
MAX_OFFSET = 2**53 - 1
REFUSALS_LOGGED_PER_LINK = 10  # then only counted (sandbox_agent_refusals_total)
EXIT_REASON_CHARS = 2000
_SIGNAL_NAME = re.compile(r"[A-Z][A-Z0-9+-]{0,15}")
BUDGET_REASONS = frozenset({"timeout", "memory", "pids", "output-limit"})
ENFORCEMENTS = frozenset({"cgroup-v2", "cgroup-v1", "none"})


def belongs(sess: HubSession, conn: AgentConnection) -> bool:
    """A session is an agent's when it is of the agent's instance *and* incarnation."""
    return sess.instance_id == conn.instance_id and sess.incarnation in (
        None,
        conn.incarnation,
    )


def exit_status(report: ExitReport) -> ExitStatus:
    """The agent's exit report, with its strings bounded (they reach rows, events and logs)."""
    signal = report.signal if _SIGNAL_NAME.fullmatch(report.signal) else None
    reason = report.error[:EXIT_REASON_CHARS]
    if report.signal and signal is None:
        reason = reason or "killed by a signal the agent named oddly"
    exceeded = report.reason if report.reason in BUDGET_REASONS else ""
    if report.reason and not exceeded:
        reason = reason or "ended for a reason the agent named oddly"
    if exceeded and not reason:
        reason = f"budget exceeded: {exceeded}"
    usage = RunUsage(
        cpu_us=max(0, report.cpu_us),
        peak_memory_bytes=max(0, report.peak_memory_bytes),
        output_bytes=max(0, report.output_bytes),
        enforcement=report.enforcement if report.enforcement in ENFORCEMENTS else "",
    )
    return ExitStatus(
        code=report.code,
        signal=signal,
        lost=False,
        reason=reason,
        exceeded=exceeded,
        usage=usage if report.enforcement else None,  # an agent that predates budgets: unknown
        # more than the agent lists is not a listing: the files path lists it instead
        listing=(
            tuple(report.listing)
            if report.listing is not None and len(report.listing) <= MAX_EXIT_LISTING
            else None
        ),
    )


def inventory_ok(inv: Inventory) -> bool:
    """Offsets an agent's session can really have."""
    return inv.ring_start <= inv.end_offset <= MAX_OFFSET


def bounded_size(cols: int, rows: int) -> tuple[int, int]:
    """A terminal size reported by an agent, within what the protocol allows (0: not known)."""
    return min(cols, proto.MAX_COLS), min(rows, proto.MAX_ROWS)


class AgentTrust:
    """Looks up the sessions agents report on, and counts what it refuses."""

    def __init__(self, table: SessionTable, metrics: Metrics) -> None:
        self._table = table
        self._refusals: dict[str, int] = {}  # per agent link (its id): refusals so far
        self._m_refused = MetricCounter(
            "sandbox_agent_refusals_total",
            "Agent reports the session hub refused, by reason (bad-id, not-owned, unknown, "
            "bad-offset, bad-inventory, over-cap)",
            ["reason"],
            registry=metrics.registry,
        )

    def mine(self, conn: AgentConnection, session_id: str, what: str) -> HubSession | None:
        """The session a message of this agent is about, if it is one of the agent's own (of
        its instance and incarnation); else the message is refused (None)."""
        sess = self._table.get(session_id)  # keys are ids the server made or checked
        if sess is not None and belongs(sess, conn):
            return sess
        if sess is not None:
            reason = "not-owned"
        elif is_session_id(session_id):
            reason = "unknown"
        else:
            reason = "bad-id"
        self.refuse(conn, what, reason, session_id)
        return None

    def refuse(self, conn: AgentConnection, what: str, reason: str, session_id: str) -> None:
        """Drop one agent message: counted always, logged for the first few of each link."""
        self._m_refused.labels(reason).inc()
        n = self._refusals.get(conn.id, 0) + 1
        self._refusals[conn.id] = n
        if n > REFUSALS_LOGGED_PER_LINK:
            return
        log.warning(
            "agent %s: %s for session %s refused (%s)%s",
            conn.instance_id,
            what,
            shown(session_id),
            reason,
            "; further refusals on this link are only counted (sandbox_agent_refusals_total)"
            if n == REFUSALS_LOGGED_PER_LINK
            else "",
            extra={"instance_id": conn.instance_id, "reason": reason},
        )

    def refused_in_registration(self, conn: AgentConnection, refused: Counter[str]) -> None:
        """Count what a registration's inventory had refused (one warning for all of it)."""
        if not refused:
            return
        for reason, count in refused.items():
            self._m_refused.labels(reason).inc(count)
        log.warning(
            "agent %s registered with sessions the server refused: %s; it is told to end "
            "the well-formed ones",
            conn.instance_id,
            ", ".join(f"{count} {reason}" for reason, count in sorted(refused.items())),
            extra={"instance_id": conn.instance_id, "refused": dict(refused)},
        )

    def forget(self, conn: AgentConnection) -> None:
        """The link is gone: its refusals are no longer counted for logging."""
        self._refusals.pop(conn.id, None)
