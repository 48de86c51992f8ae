"""The `AgentLink` gRPC service: Enroll, Renew and the Connect stream.

Identity: `Connect` and `Renew` take the instance id and its incarnation from the client
certificate that the TLS layer verified against the server CA (the `x509_pem_cert` of the auth
context) and check it is a certificate this server issued, unrevoked, for the instance's live
incarnation (a certificate of a deleted instance is refused, whatever has that id now). A
message field never decides who the agent is: `Register.instance_id` is only compared, and a
mismatch is refused.
Every refusal is counted (`sandbox_auth_failures_total`, `sandbox_agent_enrollments_total`)
and goes through the refusal gate (`auth/refusals.py`): logged, audited (`outcome=denied`) and
published as `agent.refused` once per window and peer address, the rest summarised with a count;
refused `Enroll` calls are rate-limited per peer address (`RESOURCE_EXHAUSTED`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from cryptography import x509
from sqlalchemy import select

from agentic_sandbox.broker.agentlink.ca import (
    CertificateError,
    incarnation_from_certificate,
    instance_from_certificate,
    serial_hex,
)
from agentic_sandbox.broker.agentlink.enrollment import Enrollment, EnrollmentRefused
from agentic_sandbox.broker.agentlink.link import (
    AgentConnection,
    AgentInfo,
    LinkHandler,
)
from agentic_sandbox.broker.agentlink.messages import (
    Exited,
    Opened,
    Output,
    inventory_from_pb,
)
from agentic_sandbox.broker.agentlink.registry import AgentRegistry
from agentic_sandbox.broker.auth.refusals import Refusal, RefusalGate, Verdict
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.proto import PROTOCOL_METADATA, PROTOCOLS, protocol_of
from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

REGISTER_TIMEOUT = 10.0
MAX_INVENTORY = 4096  # session ids kept from a registration (AgentInfo.session_ids)

# What the read loop does with one kind of agent message (after `register`, which comes first).
Receiver = Callable[[AgentConnection, pb.AgentMessage], None]


class PeerIdentity:
    __slots__ = ("cert", "incarnation", "instance_id", "not_after", "serial")

    def __init__(self, cert: x509.Certificate) -> None:
        self.cert = cert
        self.instance_id = instance_from_certificate(cert)
        self.incarnation = incarnation_from_certificate(cert)
        self.serial = serial_hex(cert)
        self.not_after = cert.not_valid_after_utc


def peer_host(peer: str) -> str:
    """The address of a gRPC peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`), without
    the port, which differs on every connection."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and rest:
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


def peer_certificate(context: grpc.aio.ServicerContext[Any, Any]) -> x509.Certificate | None:
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert")
    if not pems:
        return None
    return x509.load_pem_x509_certificate(pems[0])


class AgentLinkService(pb_grpc.AgentLinkServicer):
    def __init__(
        self,
        *,
        db: Database,
        enrollment: Enrollment,
        registry: AgentRegistry,
        handler: LinkHandler,
        events: EventBus,
        audit: AuditLog,
        metrics: Metrics,
        refusals: RefusalGate,
        heartbeat_ms: int,
        outbox_limit: int = 10_000,
        stream_limit: int = 128,
    ) -> None:
        self._db = db
        self._refusals = refusals
        self._enrollment = enrollment
        self._registry = registry
        self._handler = handler
        self._events = events
        self._audit = audit
        self._metrics = metrics
        self._heartbeat_ms = heartbeat_ms
        self._outbox_limit = outbox_limit
        self._stream_limit = stream_limit
        # The read loop's dispatch: message kind -> (its counter, its receiver). A new kind of
        # agent message is one entry here and one receiver below.
        receivers: dict[str, Receiver] = {
            "output": self._receive_output,
            "heartbeat": self._receive_heartbeat,
            "opened": self._receive_opened,
            "exit": self._receive_exit,
            "stream": self._receive_stream,
        }
        self._receivers = {
            kind: (metrics.grpc_messages.labels("in", kind), receive)
            for kind, receive in receivers.items()
        }
        self._m_register = metrics.grpc_messages.labels("in", "register")
        self._m_unknown = metrics.grpc_messages.labels("in", "unknown")
        # a batch counts once as "batch", and each message in it as its own kind
        self._m_batch_in = metrics.grpc_messages.labels("in", "batch")
        self._m_batch_out = metrics.grpc_messages.labels("out", "batch")
        self._m_out = {
            kind: metrics.grpc_messages.labels("out", kind)
            for kind in (
                "register_ack",
                "heartbeat_ack",
                "open",
                "input",
                "resize",
                "signal",
                "close",
                "ack",
                "stream",
            )
        }

    # ---- refusals ------------------------------------------------------------------------------
    def _refuse(
        self,
        action: str,
        instance_id: str,
        peer: str,
        reason: str,
        message: str,
        *,
        enrollment: bool = False,
    ) -> Verdict:
        """Count a refusal; audit, publish and log it through the refusal gate (once per window
        and peer address; the rest are summarised). Enroll refusals are also rate-limited per
        peer address: a limited verdict is answered RESOURCE_EXHAUSTED."""
        self._metrics.auth_failures.labels(f"agent-{action}").inc()
        if enrollment:
            self._metrics.enrollments.labels(reason).inc()
        host = peer_host(peer)
        verdict = self._refusals.refuse(
            f"agent-link:{host}",
            Refusal(
                actor=f"agent:{instance_id or 'unknown'}@{peer}",
                action=f"agent.{action}",
                subject_type="instance",
                subject_id=instance_id or "unknown",
                reason=f"{reason}: {message}",
                event="agent.refused",
                data={"action": action, "reason": reason, "message": message, "peer": peer},
                instance_id=instance_id or None,
                kind=f"{action}:{reason}",
            ),
            limit=enrollment,
        )
        if verdict.recorded:
            log.warning(
                "agent %s refused for %s: %s (%s)",
                action,
                instance_id or "?",
                message,
                reason,
                extra={"instance_id": instance_id, "peer": peer, "reason": reason},
            )
        return verdict

    async def _identity(
        self, context: grpc.aio.ServicerContext[Any, Any], action: str
    ) -> PeerIdentity:
        peer = context.peer()
        try:
            cert = peer_certificate(context)
        except ValueError:
            cert = None
        if cert is None:
            self._refuse(
                action,
                "",
                peer,
                "no_client_certificate",
                "a client certificate is required (use the mTLS listener)",
            )
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "client certificate required")
            raise AssertionError("unreachable")
        try:
            ident = PeerIdentity(cert)
            self._enrollment.ca.verify_issued(cert)
            await self._enrollment.check_certificate(
                ident.serial, ident.instance_id, ident.incarnation
            )
        except CertificateError as exc:
            self._refuse(action, "", peer, "bad_certificate", str(exc))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise AssertionError("unreachable") from None
        except EnrollmentRefused as exc:
            self._refuse(action, ident.instance_id, peer, exc.reason, exc.message)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)
            raise AssertionError("unreachable") from None
        return ident

    # ---- unary ---------------------------------------------------------------------------------
    async def Enroll(
        self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EnrollResponse:
        peer = context.peer()
        started = time.monotonic()
        try:
            issued = await self._enrollment.enroll(
                request.instance_id, request.token, bytes(request.csr_pem)
            )
        except EnrollmentRefused as exc:
            verdict = self._refuse(
                "enroll", request.instance_id[:63], peer, exc.reason, exc.message, enrollment=True
            )
            if verdict.limited:
                retry = max(1, math.ceil(verdict.retry_after))
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many refused enrollments from this address; retry in {retry}s",
                    trailing_metadata=(("retry-after", str(retry)),),
                )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)
            raise AssertionError("unreachable") from None
        self._metrics.enrollments.labels("ok").inc()
        owner = await self._owner(issued.instance_id)
        self._audit.record(
            f"agent:{issued.instance_id}@{peer}",
            "agent.enroll",
            "instance",
            issued.instance_id,
            detail={"serial": issued.serial, "not_after": issued.not_after.isoformat()},
        )
        self._events.publish(
            "agent.enrolled",
            actor=f"agent:{issued.instance_id}",
            instance_id=issued.instance_id,
            owner=owner,
            data={"serial": issued.serial, "not_after": issued.not_after.isoformat(), "peer": peer},
        )
        ms = round((time.monotonic() - started) * 1000, 1)
        log.info(
            "agent %s enrolled in %.1f ms",
            issued.instance_id,
            ms,
            extra={"instance_id": issued.instance_id, "serial": issued.serial, "ms": ms},
        )
        return pb.EnrollResponse(
            certificate_pem=issued.pem,
            ca_pem=self._enrollment.ca.certificate_pem,
            not_after_unix=int(issued.not_after.timestamp()),
        )

    async def Renew(
        self, request: pb.RenewRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RenewResponse:
        ident = await self._identity(context, "renew")
        peer = context.peer()
        try:
            issued = await self._enrollment.renew(
                ident.instance_id, ident.incarnation, ident.serial, bytes(request.csr_pem)
            )
        except EnrollmentRefused as exc:
            self._refuse("renew", ident.instance_id, peer, exc.reason, exc.message)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)
            raise AssertionError("unreachable") from None
        self._metrics.enrollments.labels("renewed").inc()
        self._audit.record(
            f"agent:{ident.instance_id}",
            "agent.renew",
            "instance",
            ident.instance_id,
            detail={"old_serial": ident.serial, "serial": issued.serial},
        )
        self._events.publish(
            "agent.renewed",
            actor=f"agent:{ident.instance_id}",
            instance_id=ident.instance_id,
            owner=await self._owner(ident.instance_id),
            data={"serial": issued.serial, "not_after": issued.not_after.isoformat()},
        )
        return pb.RenewResponse(
            certificate_pem=issued.pem,
            ca_pem=self._enrollment.ca.certificate_pem,
            not_after_unix=int(issued.not_after.timestamp()),
        )

    async def _owner(self, instance_id: str) -> str:
        async with self._db.session() as s:
            owner = await s.scalar(select(m.Instance.owner).where(m.Instance.id == instance_id))
        return owner or ""

    # ---- the stream ------------------------------------------------------------------------------
    async def Connect(
        self,
        request_iterator: AsyncIterator[pb.AgentMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ServerMessage]:
        # Why the steps run in this order:
        # - The identity comes from the verified client certificate, never from the agent's
        #   words: `register.instance_id` may only repeat it, a different one is refused.
        # - `register` must come first and within REGISTER_TIMEOUT, so a peer that connects and
        #   says nothing cannot hold a stream (and a registry slot) open.
        # - Everything the agent reports is cut to a bound before it is stored: it is untrusted
        #   input that ends up in the database, the API and the logs.
        # - The connection joins the registry (displacing an older one of the same instance)
        #   before reconciliation, so sessions reconciled against this link are routed to it;
        #   the reader starts only after the register answer, so no agent message is handled
        #   before the agent knows the server's view.
        # - Teardown is close, stop the reader, tell the handler, and detach last — in a
        #   `finally`, so a cancelled stream still reaches the handler's `on_disconnect`.
        # - The opening message is read before the certificate is judged: a refusal that
        #   arrives while the agent's first write is still in flight reaches a grpc.aio client
        #   as INTERNAL instead of the refusal's code (grpc/grpc#36066), and the agent decides
        #   on that code whether to back off for good.
        first: pb.AgentMessage | None
        try:
            async with asyncio.timeout(REGISTER_TIMEOUT):
                first = await anext(request_iterator)
        except (TimeoutError, StopAsyncIteration):
            first = None
        ident = await self._identity(context, "connect")
        peer = context.peer()
        if first is None or first.WhichOneof("body") != "register":
            self._refuse(
                "connect",
                ident.instance_id,
                peer,
                "no_register",
                "the first message must be `register`",
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected register first")
            return
        reg = first.register
        if reg.instance_id and reg.instance_id != ident.instance_id:
            self._refuse(
                "connect",
                ident.instance_id,
                peer,
                "instance_mismatch",
                f"certificate names instance {ident.instance_id!r} but the agent claims "
                f"{reg.instance_id[:63]!r}",
            )
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "this certificate belongs to another instance",
            )
            return
        protocol = protocol_of(reg.protocol)
        low, high = PROTOCOLS
        if not low <= protocol <= high:
            newer = "server" if protocol > high else "agent"
            problem = (
                f"the agent speaks link protocol {protocol}; this server speaks {low}..{high}: "
                f"upgrade the {newer}"
            )
            self._refuse("connect", ident.instance_id, peer, "protocol", problem)
            self._registry.incompatible(ident.instance_id, problem)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                problem,
                trailing_metadata=((PROTOCOL_METADATA, f"{low}-{high}"),),
            )
            return
        self._m_register.inc()
        conn = AgentConnection(
            instance_id=ident.instance_id,
            incarnation=ident.incarnation,
            owner=await self._owner(ident.instance_id),
            cert_serial=ident.serial,
            cert_not_after=ident.not_after,
            peer=peer,
            outbox_limit=self._outbox_limit,
            stream_limit=self._stream_limit,
            batches=reg.batches,
            acks_when_asked=reg.acks_when_asked,
            info=AgentInfo(
                agent_version=reg.agent_version[:64],
                hostname=reg.hostname[:255],
                boot_id=reg.boot_id[:64],
                agent_run_id=reg.agent_run_id[:64],
                ring_bytes=reg.ring_bytes,
                stream_kinds=tuple(k[:32] for k in reg.stream_kinds[:16]),
                budget_enforcement=reg.budgets.enforcement[:32],
                budgets=tuple(b[:32] for b in reg.budgets.budgets[:16]),
                budget_problem=reg.budgets.problem[:512],
                agent_bundle=reg.agent_bundle[:64],
                bundle_problem=reg.bundle_problem[:512],
                session_dirs=reg.session_dirs,
                session_ids=frozenset(s.session_id[:64] for s in reg.sessions[:MAX_INVENTORY]),
            ),
        )
        conn.task = asyncio.current_task()
        registry = self._registry
        registry.attach(conn)
        reader: asyncio.Task[None] | None = None
        try:
            reconciled = await self._handler.on_register(conn, inventory_from_pb(reg))
            conn.answer_register(registry.server_id, self._heartbeat_ms, reconciled)
            conn.registered = True
            registry.registered(conn)
            reader = asyncio.create_task(
                self._read_loop(conn, request_iterator), name=f"agent-reader-{conn.instance_id}"
            )
            reader.add_done_callback(lambda t: self._reader_done(conn, t))
            count = self._count_out
            async for msg in conn.outgoing():
                yield msg
                count(msg)
        except asyncio.CancelledError:
            if not conn.close_reason:
                raise
        finally:
            conn.close(conn.close_reason or "stream ended")
            if reader is not None and not reader.done():
                reader.cancel()
            try:
                self._handler.on_disconnect(conn)
            finally:
                registry.detach(conn)

    @staticmethod
    def _reader_done(conn: AgentConnection, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            conn.close(conn.close_reason or "stream ended")
            return
        exc = task.exception()
        if exc is not None and not conn.closed:
            log.warning(
                "agent %s link failed: %s",
                conn.instance_id,
                exc,
                extra={"instance_id": conn.instance_id},
            )
        conn.close("agent closed its stream" if exc is None else f"read failed: {exc}")

    def _count_out(self, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("body") or ""
        if kind == "batch":
            self._m_batch_out.inc()
            for inner in msg.batch.messages:
                self._count_out(inner)
            return
        counter = self._m_out.get(kind)
        if counter is not None:
            counter.inc()

    async def _read_loop(
        self, conn: AgentConnection, request_iterator: AsyncIterator[pb.AgentMessage]
    ) -> None:
        loop = asyncio.get_running_loop()
        registry = self._registry
        receivers = self._receivers
        async for msg in request_iterator:
            registry.heard_from(conn, loop.time())
            kind = msg.WhichOneof("body")
            if kind == "batch" and conn.batches:
                self._m_batch_in.inc()
                messages: Iterable[pb.AgentMessage] = msg.batch.messages
            else:
                messages = (msg,)
            for one in messages:
                # ("batch" has no receiver: a batch in a batch, or from an agent that did not
                # say it sends them, is unknown)
                kind = one.WhichOneof("body")
                entry = receivers.get(kind) if kind is not None else None
                if entry is None:
                    self._m_unknown.inc()
                    log.warning("agent %s sent an unexpected %s message", conn.instance_id, kind)
                else:
                    counter, receive = entry
                    counter.inc()
                    receive(conn, one)
                if conn.closed:
                    return

    # ---- receivers: protobuf in, typed values to the handler ---------------------------------
    def _receive_output(self, conn: AgentConnection, msg: pb.AgentMessage) -> None:
        out = msg.output  # (built inline: this runs for every output message)
        self._handler.on_output(conn, Output(out.session_id, out.offset, out.data))

    def _receive_opened(self, conn: AgentConnection, msg: pb.AgentMessage) -> None:
        self._handler.on_opened(conn, Opened.from_pb(msg.opened))

    def _receive_exit(self, conn: AgentConnection, msg: pb.AgentMessage) -> None:
        self._handler.on_exit(conn, Exited.from_pb(msg.exit))

    @staticmethod
    def _receive_heartbeat(conn: AgentConnection, msg: pb.AgentMessage) -> None:
        conn.metrics.take(msg.heartbeat)
        conn.metrics_dirty = True
        conn.last_heartbeat_at = dt.datetime.now(dt.UTC)
        if msg.heartbeat.want_ack or not conn.acks_when_asked:
            conn.answer_heartbeat(int(time.time() * 1000))

    @staticmethod
    def _receive_stream(conn: AgentConnection, msg: pb.AgentMessage) -> None:
        conn.streams.receive(msg.stream)
