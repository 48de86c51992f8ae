"""The agent-link component: the CA, enrollment, the registry and the `grpc.aio` server.

The gRPC server runs on the server's event loop (no threads for request handling) with two
ports sharing one service (guests reach both through the guest link gateway, `gateway.py`, on
`guest_link_listen`; host agents dial them directly):
- `grpc_listen` (default 127.0.0.1:8120): mutual TLS, client certificates issued by the CA are
  required — `Connect` and `Renew`;
- `grpc_enroll_listen` (default 127.0.0.1:8121): server-auth TLS only — `Enroll` (an agent has
  no certificate before it enrolls; its one-time token authenticates it). `Connect`/`Renew` there
  are refused for lack of a client certificate.
gRPC cannot make a client certificate optional on one port, hence two. While the node follows
(several control hosts), both listeners refuse every rpc and name the leader (`redirect.py`).
"""

from __future__ import annotations

import datetime as dt
import logging

import grpc
from aiohttp import web

from agentic_sandbox.broker.agentlink.ca import CertificateAuthority
from agentic_sandbox.broker.agentlink.enrollment import Enrollment
from agentic_sandbox.broker.agentlink.gateway import GatewayBindError, LinkGateway, Upstreams
from agentic_sandbox.broker.agentlink.link import LinkHandler
from agentic_sandbox.broker.agentlink.redirect import FollowerLink, release_ports
from agentic_sandbox.broker.agentlink.registry import AgentRegistry
from agentic_sandbox.broker.agentlink.service import AgentLinkService
from agentic_sandbox.broker.cluster import Leadership
from agentic_sandbox.broker.incarnations import EndedIncarnation
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


def _reachable(host: str) -> str:
    """An address this process can connect to for a listener bound to `host`."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)


class AgentLinkComponent:
    name = "agent-link"

    def __init__(self, svc: Services, handler: LinkHandler) -> None:
        settings = svc.settings
        self.svc = svc
        self.ca = CertificateAuthority(settings.data_dir / "agent-ca")
        self.enrollment = Enrollment(
            svc.db, self.ca, dt.timedelta(seconds=settings.agent_cert_ttl_seconds)
        )
        self.registry = AgentRegistry(
            svc.db,
            svc.events,
            svc.audit,
            svc.metrics,
            server_id=svc.server_id,
            heartbeat_seconds=settings.agent_heartbeat_seconds,
            stale_after=settings.agent_stale_after_heartbeats,
            disconnect_after=settings.agent_disconnect_after_heartbeats,
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
            heartbeat_ms=int(settings.agent_heartbeat_seconds * 1000),
            outbox_limit=settings.agent_outbox_messages,
            stream_limit=settings.agent_streams_per_link,
        )
        self._server: grpc.aio.Server | None = None
        self._standby: FollowerLink | None = None
        self.gateway: LinkGateway | None = None
        self.ports: dict[str, int] = {}
        svc.incarnations.on_end("agent-link", self._end_incarnation)

    async def _end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's agent is cut off at once: its live link closed, its
        certificates revoked, its unused enrollment tokens deleted."""
        closed = self.registry.end_incarnation(
            ended.instance_id,
            ended.incarnation,
            f"the instance's incarnation ended: {ended.reason}",
        )
        revoked = await self.enrollment.end_incarnation(ended.instance_id, ended.incarnation)
        await self.registry.forget(ended.instance_id)
        log.info(
            "incarnation of %s ended: link %s, %d certificates revoked",
            ended.instance_id,
            "closed" if closed else "not connected",
            revoked,
            extra={"instance_id": ended.instance_id, "incarnation": ended.incarnation},
        )

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.agentlink import routes

        app[routes.AGENT_LINK] = self
        routes.api.install(app)

    def _tls_names(self) -> tuple[str, ...]:
        settings = self.svc.settings
        names = list(settings.grpc_tls_names)
        hosts = [settings.grpc_address[0], settings.grpc_enroll_address[0]]
        for host in [*hosts, *settings.guest_link_addresses]:
            if host not in ("", "0.0.0.0", "::") and host not in names:
                names.append(host)
        return tuple(names)

    def bind(self, server: grpc.aio.Server) -> dict[str, int]:
        """Bind `server` to both agent-link listeners with their TLS (the leader's service, or
        a follower's refusals: `redirect.py`); the bound ports by label."""
        from agentic_sandbox.broker.app import StartupError

        settings = self.svc.settings
        key_pem, chain_pem = self.ca.server_credentials(self._tls_names())
        mtls = grpc.ssl_server_credentials(
            [(key_pem, chain_pem)],
            root_certificates=self.ca.certificate_pem,
            require_client_auth=True,
        )
        server_tls = grpc.ssl_server_credentials([(key_pem, chain_pem)])
        ports: dict[str, int] = {}
        for label, listen, creds in (
            ("link", settings.grpc_listen, mtls),
            ("enroll", settings.grpc_enroll_listen, server_tls),
        ):
            host, port = settings.grpc_address if label == "link" else settings.grpc_enroll_address
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                bound = server.add_secure_port(address, creds)
            except RuntimeError as exc:
                raise StartupError(f"cannot listen on {listen} (gRPC {label}): {exc}") from exc
            if not bound:
                raise StartupError(f"cannot listen on {listen} (gRPC {label})")
            ports[label] = bound
        return ports

    # ---- a follower's listeners (several control hosts) ----------------------------------
    async def stand_by(self, cluster: Leadership) -> None:
        """While this node follows: the agent-link listeners refuse, naming the leader."""
        self._standby = FollowerLink(cluster)
        try:
            await self._standby.start(self.bind)
        except Exception as exc:  # it will be tried again when this node leads
            log.warning("the follower's agent-link listeners did not start: %s", exc)
            self._standby = None

    async def stop_standing_by(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            await standby.stop()

    async def start(self) -> None:
        await self.stop_standing_by()  # its listeners are the leader's now
        settings = self.svc.settings
        await self.registry.start()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_AgentLinkServicer_to_server(self.service, server)
        try:
            self.ports = self.bind(server)
        except Exception:
            await release_ports(server)
            raise
        await server.start()
        self._server = server
        self.gateway = LinkGateway(
            Upstreams(
                link=(_reachable(settings.grpc_address[0]), self.ports["link"]),
                enroll=(_reachable(settings.grpc_enroll_address[0]), self.ports["enroll"]),
            )
        )
        try:
            self.ports["guest"] = await self.gateway.start(
                settings.guest_link_hosts, settings.guest_link_address[1]
            )
        except GatewayBindError as exc:
            from agentic_sandbox.broker.app import StartupError

            setting = (
                "guest_link_listen"
                if exc.host == settings.guest_link_address[0]
                else "guest_link_addresses"
            )
            raise StartupError(f"guest link ({setting}): {exc.strerror}") from exc

        async def ready() -> tuple[bool, str]:
            return True, f"{len(self.registry)} agents connected"

        self.svc.readiness["agent-link"] = ready
        log.info(
            "agent link listening",
            extra={
                "link": settings.grpc_listen,
                "enroll": settings.grpc_enroll_listen,
                "tls": "mutual",
            },
        )

    async def stop(self) -> None:
        await self.stop_standing_by()
        if self.gateway is not None:
            await self.gateway.stop()
        await self.registry.stop()
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
