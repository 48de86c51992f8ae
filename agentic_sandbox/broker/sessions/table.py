"""The sessions the hub holds, by id, and the gauges read from them.

Keys are ids the server made or checked (`ids.is_session_id`); an id an agent sends is looked
up here only through `trust.AgentTrust`.

Per instance, the table also keeps its sessions and the ones not yet seen ended, so what a
create or a link event asks about one instance costs what that instance holds, never what the
whole hub holds (ended sessions stay `session_retain_seconds`: under load that is rate x 300 s
of them). The live set is pruned as it is counted: a session leaves it once, when first found
ended, so a count costs at most the per-instance cap.
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
        self._of_instance: dict[str, dict[str, HubSession]] = {}
        self._live: dict[str, dict[str, HubSession]] = {}  # not yet seen ended
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
        old = self._sessions.get(sess.id)
        if old is not None:
            self.remove(old)
        self._sessions[sess.id] = sess
        self._of_instance.setdefault(sess.instance_id, {})[sess.id] = sess
        if not sess.ended:
            self._live.setdefault(sess.instance_id, {})[sess.id] = sess

    def remove(self, sess: HubSession) -> None:
        if self._sessions.get(sess.id) is not sess:
            return
        del self._sessions[sess.id]
        for index in (self._of_instance, self._live):
            held = index.get(sess.instance_id)
            if held is not None:
                held.pop(sess.id, None)
                if not held:
                    del index[sess.instance_id]

    def all(self) -> list[HubSession]:
        return list(self._sessions.values())

    def of_instance(self, instance_id: str) -> list[HubSession]:
        return list(self._of_instance.get(instance_id, {}).values())

    def live_of_instance(self, instance_id: str) -> list[HubSession]:
        """Sessions of the instance that have not ended."""
        live = self._live.get(instance_id)
        if not live:
            return []
        for sid in [sid for sid, sess in live.items() if sess.ended]:
            del live[sid]  # an ended session never runs again: it leaves the set once
        if not live:
            del self._live[instance_id]
        return list(live.values())

    def live_count(self, instance_id: str) -> int:
        """Sessions of the instance that have not ended (what the per-instance cap counts)."""
        return len(self.live_of_instance(instance_id))

    def live_instances(self) -> list[str]:
        """Instances with a session not yet seen ended."""
        return list(self._live)

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
