"""The `sandbox-server` process: one event loop for HTTP and the agent-link gRPC server.

Start-up: migrate the store, make the bootstrap admin token if none exists, start components,
listen. Shutdown on SIGTERM/SIGINT: stop accepting, drain in-flight requests for up to
`shutdown_grace_seconds`, close streams (WebSockets, SSE, agent links), flush events and audit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from agentic_sandbox.broker.app import (
    Component,
    StartupError,
    build_services,
    close_services,
    create_app,
    token_file_message,
)
from agentic_sandbox.broker.config import MetricsAccess, Settings
from agentic_sandbox.broker.http.connections import ConnectionCap, http_timeouts
from agentic_sandbox.broker.observability.component import StoreGauges
from agentic_sandbox.broker.observability.routes import metrics_app
from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

ComponentFactory = Callable[[Services], list[Component]]


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
        # One cap for both listeners: an address's connections count together.
        self.connections = ConnectionCap(settings.http_max_connections_per_address)

    async def start(self) -> Services:
        svc = self.svc = await build_services(self.settings)
        token_path = await svc.auth.ensure_bootstrap_admin(self.settings.effective_admin_token_file)
        # The foundation's own components first, then the layers built on it.
        self.components = [StoreGauges(svc), *self._component_factory(svc)]
        app = create_app(svc, self.components)
        for component in self.components:
            await component.start()
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
        self._banner(token_path)
        return svc

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
            "  " + token_file_message(token_path if token_path else None, s),  # type: ignore[arg-type]
        ]
        print("\n".join(lines), file=sys.stdout, flush=True)
        log.info("server started", extra={"http": s.http_listen, "grpc": s.grpc_listen})

    async def stop(self) -> None:
        log.info("shutting down")
        for runner in self._runners[1:]:
            await runner.cleanup()
        # Stop components first so long-lived streams (WebSockets, SSE, agent links) end and
        # do not hold the drain open; then let in-flight requests finish.
        for component in reversed(self.components):
            try:
                await component.stop()
            except Exception:
                log.exception("stopping %s failed", component.name)
        if self.svc is not None:
            self.svc.events.end_streams()
        if self._runners:
            await self._runners[0].cleanup()
        if self.svc is not None:
            await close_services(self.svc)
        self._stopped.set()

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            await self.stop()
