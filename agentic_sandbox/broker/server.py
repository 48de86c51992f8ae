"""The `sandbox-server` process: one event loop for HTTP and the agent-link gRPC server.

Start-up: migrate the store, make the bootstrap admin token if none exists, start components,
listen. Shutdown on SIGTERM/SIGINT: stop accepting, drain in-flight requests for up to
`shutdown_grace_seconds`, close streams (WebSockets, SSE, agent links), flush events and audit.

Roles (`broker/cluster/`): on SQLite the server owns its data dir (`server.lock`) and leads at
once. On PostgreSQL it listens for HTTP as a follower (serving the `follower=True` routes,
redirecting the rest) and starts its components — today's order — once it is elected; losing
leadership ends the process with `EXIT_LOST_LEADERSHIP` (a supervisor restarts it as a
follower). A graceful stop flushes every write, then unlocks, so a follower takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

from aiohttp import web

from agentic_sandbox.broker.app import (
    Component,
    StandbyComponent,
    StartupError,
    build_services,
    close_services,
    create_app,
    token_file_message,
)
from agentic_sandbox.broker.cluster import (
    DataDirBusy,
    Elector,
    EventTail,
    Leadership,
    NodeInfo,
    Role,
    SingleNode,
)
from agentic_sandbox.broker.config import MetricsAccess, Settings
from agentic_sandbox.broker.http import health
from agentic_sandbox.broker.http.connections import ConnectionCap, http_timeouts
from agentic_sandbox.broker.observability.component import StoreGauges
from agentic_sandbox.broker.observability.routes import metrics_app
from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

SLOW_STOP_SECONDS = 0.5  # a step of the shutdown that takes longer is logged


@contextlib.contextmanager
def _took(what: str) -> Iterator[None]:
    """Log `what` when it took longer than SLOW_STOP_SECONDS (where a slow stop's time went)."""
    started = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - started
        if seconds > SLOW_STOP_SECONDS:
            log.info("%s took %.1fs", what, seconds, extra={"seconds": round(seconds, 2)})


ComponentFactory = Callable[[Services], list[Component]]
EXIT_LOST_LEADERSHIP = 75  # EX_TEMPFAIL: this node stopped leading; restart it as a follower


def default_components(svc: Services) -> list[Component]:
    """The server's parts beyond the foundation; each layer adds itself here."""
    from agentic_sandbox.broker.components import build_components

    return build_components(svc)


class Server:
    def __init__(
        self, settings: Settings, component_factory: ComponentFactory = default_components
    ) -> None:
        self.settings = settings
        self._component_factory = component_factory
        self.svc: Services | None = None
        self.components: list[Component] = []
        self._runners: list[web.AppRunner] = []
        self._stopped = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self.exit_code = 0
        self.cluster: Leadership | None = None
        self._started: list[Component] = []
        self._leading: asyncio.Task[None] | None = None
        self._tail: EventTail | None = None  # a follower's tail of the leader's events
        self.leading = asyncio.Event()  # set once this node's components run (it leads)
        # One cap for both listeners: an address's connections count together.
        self.connections = ConnectionCap(settings.http_max_connections_per_address)

    async def start(self) -> Services:
        s = self.settings
        me = NodeInfo(s.node_name, s.effective_public_url, s.grpc_listen, health.VERSION)
        single = s.effective_database_url.startswith("sqlite")
        if single:  # before the database is opened: a second server stops here
            self.cluster = SingleNode(me, s.data_dir)
            try:
                await self.cluster.start()
            except DataDirBusy as exc:
                raise StartupError(str(exc)) from None
        svc = self.svc = await build_services(s)
        if not single:
            self.cluster = Elector(svc.db, me)
            self.cluster.on_lost(self._lost_leadership)
            svc.leading = False
            svc.readiness["leadership"] = self._leadership_check
            self._tail = EventTail(svc.db, svc.events.pull, node=s.node_name)
            self._tail.start()
        assert self.cluster is not None
        svc.cluster = self.cluster
        async with svc.db.exclusively():  # nodes starting together make one token
            token_path = await svc.auth.ensure_bootstrap_admin(s.effective_admin_token_file)
        # The foundation's own components first, then the layers built on it.
        self.components = [StoreGauges(svc), *self._component_factory(svc)]
        app = create_app(svc, self.components)
        if single:
            await self._lead()
        else:
            for component in self.components:
                if isinstance(component, StandbyComponent):
                    await component.stand_by(self.cluster)
            await self.cluster.start()
        await self._listen(app, svc)
        if not single:
            self._leading = asyncio.create_task(self._lead_when_elected(), name="lead")
        self._banner(token_path)
        return svc

    async def _lead(self, *, announce: bool = False) -> None:
        """This node leads: take the event sequence over and start every component. An
        elected node says so first: `cluster.leader_changed` is the new term's first event."""
        assert self.svc is not None
        if self._tail is not None:  # the bus pulls the last of the old leader's events itself
            await self._tail.stop()
            self._tail = None
        await self.svc.events.lead()
        if announce and self.cluster is not None:
            me = self.cluster.me
            self.svc.events.publish(
                "cluster.leader_changed",
                actor=f"node:{me.node}",
                data={
                    "node": me.node,
                    "url": me.url,
                    "term": self.cluster.term,
                    "previous": self.cluster.previous_leader,
                },
            )
        for component in self.components:
            await component.start()
            self._started.append(component)
        self.svc.leading = True
        self.leading.set()

    async def _lead_when_elected(self) -> None:
        assert self.cluster is not None
        await self.cluster.elected()
        try:
            await self._lead(announce=True)
        except Exception:
            log.exception("starting as the leader failed")
            self.exit_code = 1
            self._stop_requested.set()
            return
        log.info("serving as the leader", extra={"term": self.cluster.term})

    async def _leadership_check(self) -> tuple[bool, str]:
        """Ready as a follower (it serves reads) or as a leader whose components run; not
        while an elected node is still starting them."""
        assert self.cluster is not None and self.svc is not None
        c = self.cluster
        if c.role is Role.leader:
            if self.svc.leading:
                return True, f"leader of term {c.term}"
            return False, f"elected (term {c.term}); starting the leader's components"
        if c.leader is None:
            return True, "follower; no node leads right now"
        return True, f"follower of {c.leader.node} ({c.leader.url}), term {c.term}"

    def _lost_leadership(self, reason: str) -> None:
        log.error("stepping down (exit %d): %s", EXIT_LOST_LEADERSHIP, reason)
        self.exit_code = EXIT_LOST_LEADERSHIP
        self._stop_requested.set()

    async def _listen(self, app: web.Application, svc: Services) -> None:
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=self.settings.shutdown_grace_seconds,
            handle_signals=False,
            **http_timeouts(self.settings),
        )
        await runner.setup()
        assert runner.server is not None
        self.connections.install(runner.server)
        host, port = self.settings.http_address
        self._runners.append(runner)
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartupError(f"cannot listen on {host}:{port} (HTTP): {reason}") from exc
        if self.settings.metrics_access is MetricsAccess.listener:
            mrunner = web.AppRunner(
                metrics_app(svc),
                access_log=None,
                handle_signals=False,
                **http_timeouts(self.settings),
            )
            await mrunner.setup()
            assert mrunner.server is not None
            self.connections.install(mrunner.server)
            mhost, mport = self.settings.metrics_address
            await web.TCPSite(mrunner, mhost, mport, reuse_address=True).start()
            self._runners.append(mrunner)

    def _banner(self, token_path: object) -> None:
        s = self.settings
        url = s.effective_public_url
        db = "SQLite" if s.effective_database_url.startswith("sqlite") else "PostgreSQL"
        lines = [
            "agentic-sandbox server is up",
            f"  dashboard:   {url}/",
            f"  admin API:   {url}/api/v2/admin/  (OpenAPI: {url}/api/openapi.json)",
            f"  agent link:  {s.grpc_listen} (gRPC, mTLS)",
            f"  data dir:    {s.data_dir} ({db})",
            f"  node:        {self._role_line()}",
            "  " + token_file_message(token_path if token_path else None, s),  # type: ignore[arg-type]
        ]
        print("\n".join(lines), file=sys.stdout, flush=True)
        log.info("server started", extra={"http": s.http_listen, "grpc": s.grpc_listen})

    def _role_line(self) -> str:
        s, cluster = self.settings, self.cluster
        if cluster is None or cluster.role is Role.single:
            return f"{s.node_name}, single-node (SQLite: this server owns the data dir)"
        return f"{s.node_name}, one of several on PostgreSQL (leads when elected)"

    async def stop(self) -> None:
        log.info("shutting down")
        if self._leading is not None:
            self._leading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._leading
        if self._tail is not None:
            await self._tail.stop()
            self._tail = None
        for runner in self._runners[1:]:
            await runner.cleanup()
        for component in self.components:
            if isinstance(component, StandbyComponent) and component not in self._started:
                with contextlib.suppress(Exception):
                    await component.stop_standing_by()
        # Stop components first so long-lived streams (WebSockets, SSE, agent links) end and
        # do not hold the drain open; then let in-flight requests finish.
        for component in reversed(self._started):
            with _took(f"stopping {component.name}"):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %s failed", component.name)
        if self.svc is not None:
            self.svc.events.end_streams()
        if self._runners:
            with _took("draining HTTP requests"):
                await self._runners[0].cleanup()
        if self.svc is not None:
            with _took("closing services"):
                await close_services(self.svc)  # the last writes are flushed …
        if self.cluster is not None:
            await self.cluster.stop()  # … before a follower may take over
        self._stopped.set()

    async def run_forever(self) -> int:
        """Serve until SIGTERM/SIGINT (0) or a loss of leadership (`EXIT_LOST_LEADERSHIP`)."""
        loop = asyncio.get_running_loop()
        stop = self._stop_requested
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            await stop.wait()
            return self.exit_code
        finally:
            with contextlib.suppress(Exception):
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            await self.stop()
