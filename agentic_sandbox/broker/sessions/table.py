"""The sessions the hub holds, by id, and the gauges read from them.

Keys are ids the server made or checked (`ids.is_session_id`); an id an agent sends is looked
up here only through `trust.AgentTrust`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions import protocol as proto
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.broker.sessions.states import SessionState


class SessionTable:
    def __init__(self, metrics: Metrics) -> None:
        self._sessions: dict[str, HubSession] = {}
        # The dict's own lookup, not a method around it: it runs for every output message.
        self.get: Callable[[str], HubSession | None] = self._sessions.get
        metrics.provide(
            "sandbox_sessions",
            "Sessions held by the hub, by state",
            ("state",),
            self._by_state,
        )
        metrics.provide(
            "sandbox_session_clients",
            "Clients attached to sessions, by role",
            ("role",),
            self._clients_by_role,
        )

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __iter__(self) -> Iterator[HubSession]:
        return iter(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def holds(self, sess: HubSession) -> bool:
        """Still held (not evicted, the hub not stopped)."""
        return self._sessions.get(sess.id) is sess

    def add(self, sess: HubSession) -> None:
        self._sessions[sess.id] = sess

    def remove(self, sess: HubSession) -> None:
        self._sessions.pop(sess.id, None)

    def all(self) -> list[HubSession]:
        return list(self._sessions.values())

    def of_instance(self, instance_id: str) -> list[HubSession]:
        return [sess for sess in self._sessions.values() if sess.instance_id == instance_id]

    def live_count(self, instance_id: str) -> int:
        """Sessions of the instance that have not ended (what the per-instance cap counts)."""
        return sum(
            1
            for sess in self._sessions.values()
            if sess.instance_id == instance_id and not sess.ended
        )

    def _by_state(self) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {
            (SessionState.starting.value,): 0.0,
            (SessionState.running.value,): 0.0,
        }
        for sess in self._sessions.values():
            key = (sess.state.value,)
            out[key] = out.get(key, 0.0) + 1
        return out

    def _clients_by_role(self) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {
            (proto.ROLE_CONTROLLER,): 0.0,
            (proto.ROLE_OBSERVER,): 0.0,
        }
        for sess in self._sessions.values():
            for client in sess.clients.values():
                out[(client.role,)] += 1
        return out
