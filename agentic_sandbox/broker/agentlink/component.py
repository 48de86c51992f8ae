"""The agent-link component: the CA, enrollment, the registry and the `grpc.aio` server.

The gRPC server runs on the server's event loop (no threads for request handling) with two
ports sharing one service:
- `grpc_listen` (default 127.0.0.1:8120): mutual TLS, client certificates issued by the CA are
  required — `Connect` and `Renew`;
- `grpc_enroll_listen` (default 127.0.0.1:8121): server-auth TLS only — `Enroll` (an agent has
  no certificate before it enrolls; its one-time token authenticates it). `Connect`/`Renew` there
  are refused for lack of a client certificate.
gRPC cannot make a client certificate optional on one port, hence two.
"""

from __future__ import annotations

import datetime as dt
import logging

import grpc
from aiohttp import web

from agentic_sandbox.broker.agentlink.ca import CertificateAuthority
from agentic_sandbox.broker.agentlink.enrollment import Enrollment
from agentic_sandbox.broker.agentlink.link import LinkHandler
from agentic_sandbox.broker.agentlink.registry import AgentRegistry
from agentic_sandbox.broker.agentlink.service import AgentLinkService
from agentic_sandbox.broker.services import Services
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
]


class AgentLinkError(Exception):
    pass


class AgentLinkComponent:
    name = "agent-link"

    def __init__(self, svc: Services, handler: LinkHandler) -> None:
        s = svc.settings
        self.svc = svc
        self.ca = CertificateAuthority(s.data_dir / "agent-ca")
        self.enrollment = Enrollment(
            svc.db, self.ca, dt.timedelta(seconds=s.agent_cert_ttl_seconds)
        )
        self.registry = AgentRegistry(
            svc.db,
            svc.events,
            svc.audit,
            svc.metrics,
            server_id=svc.server_id,
            heartbeat_seconds=s.agent_heartbeat_seconds,
            stale_after=s.agent_stale_after_heartbeats,
            disconnect_after=s.agent_disconnect_after_heartbeats,
        )
        self.service = AgentLinkService(
            db=svc.db,
            enrollment=self.enrollment,
            registry=self.registry,
            handler=handler,
            events=svc.events,
            audit=svc.audit,
            metrics=svc.metrics,
            refusals=svc.refusals,
            heartbeat_ms=int(s.agent_heartbeat_seconds * 1000),
            outbox_limit=s.agent_outbox_messages,
        )
        self._server: grpc.aio.Server | None = None
        self.ports: dict[str, int] = {}

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.agentlink import routes

        app[routes.AGENT_LINK] = self
        routes.api.install(app)

    def _tls_names(self) -> tuple[str, ...]:
        names = list(self.svc.settings.grpc_tls_names)
        for host, _ in (self.svc.settings.grpc_address, self.svc.settings.grpc_enroll_address):
            if host not in ("", "0.0.0.0", "::") and host not in names:
                names.append(host)
        return tuple(names)

    async def start(self) -> None:
        from agentic_sandbox.broker.app import StartupError

        s = self.svc.settings
        await self.registry.start()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_AgentLinkServicer_to_server(self.service, server)
        key_pem, chain_pem = self.ca.server_credentials(self._tls_names())
        mtls = grpc.ssl_server_credentials(
            [(key_pem, chain_pem)],
            root_certificates=self.ca.certificate_pem,
            require_client_auth=True,
        )
        server_tls = grpc.ssl_server_credentials([(key_pem, chain_pem)])
        for label, listen, creds in (
            ("link", s.grpc_listen, mtls),
            ("enroll", s.grpc_enroll_listen, server_tls),
        ):
            host, port = s.grpc_address if label == "link" else s.grpc_enroll_address
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                bound = server.add_secure_port(address, creds)
            except RuntimeError as exc:
                raise StartupError(f"cannot listen on {listen} (gRPC {label}): {exc}") from exc
            if not bound:
                raise StartupError(f"cannot listen on {listen} (gRPC {label})")
            self.ports[label] = bound
        await server.start()
        self._server = server

        async def ready() -> tuple[bool, str]:
            return True, f"{len(self.registry)} agents connected"

        self.svc.readiness["agent-link"] = ready
        log.info(
            "agent link listening",
            extra={"link": s.grpc_listen, "enroll": s.grpc_enroll_listen, "tls": "mutual"},
        )

    async def stop(self) -> None:
        await self.registry.stop()
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
