"""Which agents are connected, and whether they are alive.

One connection per instance (a new one replaces an old one). A liveness sweep marks an agent
`stale` after 3 silent heartbeat intervals and closes its link after more (it is then
`disconnected`); a certificate that expires on a live link closes it too (the agent reconnects
with its renewed certificate). State changes are written to `agent_links` and
`instances.agent_state` and published as `agent.*` events; heartbeat metrics are written in one
batch now and then, never per heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy import delete, select, update

from agentic_sandbox.broker.agentlink.link import AgentConnection
from agentic_sandbox.broker.agentlink.stream_kinds import EgressOpened
from agentic_sandbox.broker.agentlink.streams import ServerStream
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

# serves one stream an agent opened (egress), knowing whose link it came on
LinkAcceptor = Callable[[AgentConnection, ServerStream, EgressOpened], Awaitable[None]]

METRICS_FLUSH_SECONDS = 30.0


class AgentRegistry:
    def __init__(
        self,
        db: Database,
        events: EventBus,
        audit: AuditLog,
        metrics: Metrics,
        *,
        server_id: str,
        heartbeat_seconds: float,
        stale_after: int,
        disconnect_after: int,
    ) -> None:
        self._db = db
        self._events = events
        self._audit = audit
        self._metrics = metrics
        self.server_id = server_id
        self.heartbeat_seconds = heartbeat_seconds
        self.stale_after = stale_after
        self.disconnect_after = disconnect_after
        self._links: dict[str, AgentConnection] = {}
        # why an instance's agent was last refused for good (a protocol it does not share with
        # this server), until it links; keyed by certified instance ids only
        self._problems: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._db_writes: set[asyncio.Task[None]] = set()
        self._last_flush = 0.0
        self.listeners: list[Callable[[AgentConnection, str], None]] = []
        # agent-opened streams by kind (egress): bound to each link as it attaches
        self.stream_acceptors: dict[str, LinkAcceptor] = {}
        metrics.provide(
            "sandbox_agents",
            "Agents with a live link, by state (connected, stale)",
            ("state",),
            self._by_state,
        )

    def _by_state(self) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {("connected",): 0.0, ("stale",): 0.0}
        for conn in self._links.values():
            if conn.state in ("connected", "stale"):
                out[(conn.state,)] += 1
        return out

    # ---- queries ----------------------------------------------------------------------------
    def get(self, instance_id: str) -> AgentConnection | None:
        return self._links.get(instance_id)

    def problem(self, instance_id: str) -> str | None:
        """Why the instance's agent cannot link (it was refused since its last link)."""
        return self._problems.get(instance_id)

    def incompatible(self, instance_id: str, problem: str) -> None:
        self._problems[instance_id] = problem

    def ready(self, instance_id: str, incarnation: str | None = None) -> bool:
        """A registered, live link of `instance_id` (of that `incarnation`, when given)."""
        conn = self._links.get(instance_id)
        if conn is None or not conn.ready:
            return False
        return incarnation is None or conn.incarnation == incarnation

    def end_incarnation(self, instance_id: str, incarnation: str, reason: str) -> bool:
        """Close the live link of an ended incarnation at once; whether one was open."""
        conn = self._links.get(instance_id)
        if conn is None or conn.incarnation != incarnation:
            return False
        conn.close(reason)
        return True

    async def forget(self, instance_id: str) -> None:
        """Drop the recorded link state of an instance that is gone."""
        self._problems.pop(instance_id, None)
        async with self._db.session() as s:
            await s.execute(delete(m.AgentLink).where(m.AgentLink.instance_id == instance_id))

    def all(self) -> list[AgentConnection]:
        return list(self._links.values())

    def __len__(self) -> int:
        return len(self._links)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        # Links recorded by an earlier run of this server are gone.
        async with self._db.session() as s:
            await s.execute(
                update(m.AgentLink)
                .where(m.AgentLink.server_id == self.server_id)
                .values(state="disconnected")
            )
        self._task = asyncio.create_task(self._sweep(), name="agent-liveness")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for conn in list(self._links.values()):
            conn.close("server shutting down")
        if self._db_writes:
            await asyncio.gather(*self._db_writes, return_exceptions=True)

    def attach(self, conn: AgentConnection) -> None:
        self._problems.pop(conn.instance_id, None)
        old = self._links.get(conn.instance_id)
        if old is not None and old is not conn:
            log.warning(
                "agent %s connected again; closing its previous link",
                conn.instance_id,
                extra={"instance_id": conn.instance_id, "old_peer": old.peer, "peer": conn.peer},
            )
            old.close("replaced by a newer connection")
            self._metrics.agent_link_events.labels("replaced").inc()
        self._links[conn.instance_id] = conn
        for kind, acceptor in self.stream_acceptors.items():
            conn.streams.acceptors[kind] = functools.partial(acceptor, conn)
        self._metrics.agent_link_events.labels("connected").inc()
        self._events.publish(
            "agent.connected",
            actor=f"agent:{conn.instance_id}",
            instance_id=conn.instance_id,
            owner=conn.owner,
            data={
                "peer": conn.peer,
                "agent_version": conn.info.agent_version,
                "hostname": conn.info.hostname,
                "link_id": conn.id,
            },
        )
        self._audit.transition(
            f"agent:{conn.instance_id}",
            "agent",
            conn.instance_id,
            None,
            "connected",
            cause=f"link {conn.id} from {conn.peer}",
        )
        self._persist_state(conn, "connected", connected=True)
        self._notify(conn, "connected")

    def registered(self, conn: AgentConnection) -> None:
        """The link's registration was answered: it may carry server-opened streams now
        (listeners hear `registered`, after `connected`)."""
        if self._links.get(conn.instance_id) is conn:
            self._notify(conn, "registered")

    def detach(self, conn: AgentConnection) -> None:
        if self._links.get(conn.instance_id) is conn:
            del self._links[conn.instance_id]
            self._metrics.agent_link_events.labels("disconnected").inc()
            self._events.publish(
                "agent.disconnected",
                actor=f"agent:{conn.instance_id}",
                instance_id=conn.instance_id,
                owner=conn.owner,
                data={"reason": conn.close_reason or "stream ended", "link_id": conn.id},
            )
            self._audit.transition(
                f"agent:{conn.instance_id}",
                "agent",
                conn.instance_id,
                conn.state,
                "disconnected",
                cause=conn.close_reason or "stream ended",
            )
            self._persist_state(conn, "disconnected")
            self._notify(conn, "disconnected")

    def heard_from(self, conn: AgentConnection, now: float) -> None:
        conn.last_seen = now
        if conn.state == "stale":
            conn.state = "connected"
            self._events.publish(
                "agent.ready",
                actor=f"agent:{conn.instance_id}",
                instance_id=conn.instance_id,
                owner=conn.owner,
                data={"link_id": conn.id, "after": "stale"},
            )
            self._persist_state(conn, "connected")
            self._notify(conn, "connected")

    def _notify(self, conn: AgentConnection, state: str) -> None:
        for fn in self.listeners:
            try:
                fn(conn, state)
            except Exception:
                log.exception("agent state listener failed")

    # ---- persistence --------------------------------------------------------------------------
    def _persist_state(self, conn: AgentConnection, state: str, *, connected: bool = False) -> None:
        async def write() -> None:
            now = dt.datetime.now(dt.UTC)
            try:
                async with self._db.session() as s:
                    live = await s.scalar(
                        select(m.Instance.incarnation).where(
                            m.Instance.id == conn.instance_id, m.Instance.deleted_at.is_(None)
                        )
                    )
                    if live != conn.incarnation:
                        return  # an ended incarnation's link: nothing of it is recorded
                    row = await s.get(m.AgentLink, conn.instance_id)
                    if row is None:
                        row = m.AgentLink(
                            instance_id=conn.instance_id, server_id=self.server_id, state=state
                        )
                        s.add(row)
                    elif state == "disconnected" and row.server_id != self.server_id:
                        return  # another server owns it now
                    row.server_id = self.server_id
                    row.state = state
                    if connected:
                        row.connected_at = conn.connected_at
                        row.agent_version = conn.info.agent_version[:64]
                    row.last_heartbeat_at = conn.last_heartbeat_at or row.last_heartbeat_at
                    row.metrics = conn.metrics.as_dict()
                    await s.execute(
                        update(m.Instance)
                        .where(m.Instance.id == conn.instance_id)
                        .values(agent_state=state, updated_at=now)
                    )
            except Exception:
                log.exception(
                    "recording agent state failed", extra={"instance_id": conn.instance_id}
                )

        task = asyncio.create_task(write(), name=f"agent-state-{conn.instance_id}")
        self._db_writes.add(task)
        task.add_done_callback(self._db_writes.discard)

    async def _flush_metrics(self) -> None:
        dirty = [c for c in self._links.values() if c.metrics_dirty]
        if not dirty:
            return
        rows = []
        for conn in dirty:
            conn.metrics_dirty = False
            rows.append(
                {
                    "instance_id": conn.instance_id,
                    "metrics": conn.metrics.as_dict(),
                    "last_heartbeat_at": conn.last_heartbeat_at,
                }
            )
        async with self._db.session() as s:
            await s.execute(update(m.AgentLink), rows)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        period = max(0.05, self.heartbeat_seconds / 2)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            wall = dt.datetime.now(dt.UTC)
            for conn in list(self._links.values()):
                silent = now - conn.last_seen
                if silent > self.disconnect_after * self.heartbeat_seconds:
                    log.warning(
                        "agent %s silent for %.1fs; closing its link",
                        conn.instance_id,
                        silent,
                        extra={"instance_id": conn.instance_id},
                    )
                    conn.close(f"silent for {silent:.1f}s")
                elif (
                    silent > self.stale_after * self.heartbeat_seconds and conn.state == "connected"
                ):
                    conn.state = "stale"
                    self._metrics.agent_link_events.labels("stale").inc()
                    self._events.publish(
                        "agent.stale",
                        actor=f"agent:{conn.instance_id}",
                        instance_id=conn.instance_id,
                        owner=conn.owner,
                        data={"silent_seconds": round(silent, 1), "link_id": conn.id},
                    )
                    self._audit.transition(
                        "server",
                        "agent",
                        conn.instance_id,
                        "connected",
                        "stale",
                        cause=f"no heartbeat for {silent:.1f}s",
                    )
                    self._persist_state(conn, "stale")
                    self._notify(conn, "stale")
                if conn.cert_not_after <= wall and not conn.closed:
                    log.info(
                        "agent %s certificate expired on a live link; closing it", conn.instance_id
                    )
                    conn.close("certificate expired")
            if now - self._last_flush >= METRICS_FLUSH_SECONDS:
                self._last_flush = now
                try:
                    await self._flush_metrics()
                except Exception:
                    log.exception("writing agent metrics failed")
