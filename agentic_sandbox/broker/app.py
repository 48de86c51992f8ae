"""Assembles the server: services, the aiohttp application and its components.

A *component* is a part of the server with a lifecycle (the agent-link gRPC server, the session
hub, the fleet, the task scheduler, …). Each one adds its routes while the app is built and is
started and stopped in order by `Server`.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from pathlib import Path
from typing import Protocol, runtime_checkable

from aiohttp import web

from agentic_sandbox.broker.auth import routes as auth_routes
from agentic_sandbox.broker.auth.ratelimit import RateLimiter
from agentic_sandbox.broker.auth.refusals import RefusalGate
from agentic_sandbox.broker.auth.service import AuthService
from agentic_sandbox.broker.auth.streams import LiveStreams
from agentic_sandbox.broker.cluster import Leadership
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.dashboard import DashboardAssetsMissing, install_dashboard
from agentic_sandbox.broker.http import health
from agentic_sandbox.broker.http.leader import leader_middleware
from agentic_sandbox.broker.http.middleware import (
    auth_middleware,
    request_context_middleware,
    security_headers_middleware,
)
from agentic_sandbox.broker.http.problems import problem_middleware
from agentic_sandbox.broker.incarnations import Incarnations
from agentic_sandbox.broker.observability import routes as obs_routes
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.eventlog import SqlEventLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics, provide_writer_metrics
from agentic_sandbox.broker.secrets import routes as secret_routes
from agentic_sandbox.broker.secrets.vault import Vault
from agentic_sandbox.broker.services import SERVICES, Services
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store.health import StorageHealth
from agentic_sandbox.fleet import guard_dir, qemu_gid

log = logging.getLogger(__name__)


class StartupError(Exception):
    """Start-up cannot go on; the message says what and why in one line."""


def masked_url(url: str) -> str:
    """A database URL safe to print (password replaced)."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


class Component(Protocol):
    """A part of the server with routes and a lifecycle."""

    name: str

    def install(self, app: web.Application) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class StandbyComponent(Component, Protocol):
    """A component with a part to play while its node follows (several control hosts): it
    stands by from start-up until the node leads (then `start` runs) or stops."""

    async def stand_by(self, cluster: Leadership) -> None: ...

    async def stop_standing_by(self) -> None: ...


async def build_services(settings: Settings) -> Services:
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        # QEMU traverses it to the fleet's folders; no other local user gets in
        guard_dir(data_dir, qemu_gid(settings.qemu_group))
    except PermissionError:
        pass
    db = Database(settings.effective_database_url)
    try:
        await db.migrate()
    except Exception as exc:
        await db.close()
        reason = getattr(exc, "orig", None) or exc
        raise StartupError(
            f"database {masked_url(settings.effective_database_url)} is not usable: "
            f"{type(reason).__name__}: {reason}"
        ) from exc
    metrics = Metrics()
    # With several nodes (PostgreSQL) the bus waits on standby until this node leads.
    events = EventBus(
        SqlEventLog(db, retention=settings.events_retention),
        ring_size=settings.events_ring_size,
        standby=db.dialect != "sqlite",
        group=db.write_behind,
    )
    events.add_listener(lambda ev: metrics.events_published.labels(ev.type.split(".", 1)[0]).inc())
    audit = AuditLog(db)
    streams = LiveStreams(max_per_credential=settings.streams_max_per_credential)
    svc = Services(
        settings=settings,
        db=db,
        events=events,
        audit=audit,
        metrics=metrics,
        auth=AuthService(db, streams, web_session_ttl=settings.web_session_ttl_seconds),
        vault=Vault(db, data_dir / "secrets.key"),
        ratelimit=RateLimiter(settings.rate_limit_per_minute, settings.rate_limit_burst),
        incarnations=Incarnations(db),
        refusals=RefusalGate(
            audit,
            events,
            burst=settings.auth_refusal_burst,
            per_minute=settings.auth_refusals_per_minute,
            window_seconds=settings.auth_refusal_window_seconds,
        ),
        streams=streams,
        server_id=secrets.token_hex(6),
        started_at=dt.datetime.now(dt.UTC),
        writers=[events.writer, audit.writer],
    )
    provide_writer_metrics(metrics, svc.writers)
    svc.readiness["storage"] = StorageHealth(db, data_dir, settings.node_name).check
    svc.incarnations.on_end("api-keys and shares", svc.auth.end_incarnation)
    svc.incarnations.on_end("secret bindings", svc.vault.end_incarnation)
    metrics.build_info.labels(health.VERSION).set(1)
    await events.start()
    await audit.start()
    await svc.refusals.start()
    await svc.vault.teach_redactor()
    return svc


def create_app(svc: Services, components: list[Component]) -> web.Application:
    app = web.Application(
        middlewares=[
            request_context_middleware,
            problem_middleware,
            security_headers_middleware,
            leader_middleware,
            auth_middleware,
        ],
        client_max_size=svc.settings.max_body_bytes,
    )
    app[SERVICES] = svc
    for routes in (health.api, auth_routes.api, secret_routes.api, obs_routes.api):
        routes.install(app)
    if svc.settings.metrics_access.value != "listener":
        obs_routes.install_metrics(app)
    for component in components:
        component.install(app)
    try:
        install_dashboard(app)
    except DashboardAssetsMissing as exc:
        raise StartupError(str(exc)) from None
    return app


async def close_services(svc: Services) -> None:
    await svc.refusals.close()  # its last summaries go to the audit log and events
    await svc.events.close()
    await svc.audit.close()
    await svc.db.close()


def token_file_message(path: Path | None, settings: Settings) -> str:
    if path is not None:
        return f"admin token written to {path} (mode 0600; shown nowhere else)"
    return f"admin token: in {settings.effective_admin_token_file} (mode 0600, made on first start)"
