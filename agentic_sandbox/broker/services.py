"""The server's components, built once at start-up and reachable from every handler.

Handlers get them with `services(request)`; components never reach for globals.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from agentic_sandbox.broker.auth.ratelimit import RateLimiter
from agentic_sandbox.broker.auth.refusals import RefusalGate
from agentic_sandbox.broker.auth.service import AuthService
from agentic_sandbox.broker.auth.streams import LiveStreams
from agentic_sandbox.broker.cluster import Leadership
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.incarnations import Incarnations
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics, WriterStats
from agentic_sandbox.broker.secrets.vault import Vault
from agentic_sandbox.broker.store import Database

ReadinessCheck = Callable[[], Awaitable[tuple[bool, str]]]


@dataclass
class Services:
    settings: Settings
    db: Database
    events: EventBus
    audit: AuditLog
    metrics: Metrics
    auth: AuthService
    vault: Vault
    ratelimit: RateLimiter
    incarnations: Incarnations
    refusals: RefusalGate
    streams: LiveStreams
    server_id: str
    started_at: dt.datetime
    readiness: dict[str, ReadinessCheck] = field(default_factory=dict)
    # the write-behind writers whose backlog and drops are metrics (a component adds its own)
    writers: list[WriterStats] = field(default_factory=list)
    # who leads (set by the server at start); None only in tests that build services alone
    cluster: Leadership | None = None
    # the leader's components have started: this node serves every route (a follower, or a
    # leader still taking over, serves only the routes flagged `follower=True`)
    leading: bool = True


SERVICES = web.AppKey("services", Services)


def services(request: web.Request) -> Services:
    return request.app[SERVICES]
