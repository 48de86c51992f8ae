"""The egress component: the proxy behind every `allowlist` guest and its admin routes, and
the delivery of the incarnation's CA (for brokered credentials) to the guest.

**How the CA reaches the guest.** Over the agent link, at every registration: when a link of
an agent that accepts `egress_trust` streams (allowlist guests: their seed sets the agent's
`egress_ca_file` and `egress_ca_bundle`) has registered, the server opens one such stream with
the CA certificate of the link's incarnation; the agent writes it into the guest's trust store
and rebuilds it (`update-ca-certificates`), and its close says so — recorded as the event
`egress.ca.installed` (or `egress.ca.failed`) with the CA's SHA-256 fingerprint. The seed never
carries it: a clone or a warm-pool member boots from another guest's memory and then enrolls as
a new incarnation (a new CA), and a server restart makes a new CA too (it lives in memory only);
each of those is a new registration, so each gets the CA that is current. A credential change
that changes the brokered destinations makes a new CA (its name constraints name them), sent to
the connected guest at once the same way; until the guest has installed it (the event), a
brokered connection fails the guest's TLS check rather than reach the destination unbrokered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from agentic_sandbox.broker.agentlink import (
    AgentConnection,
    AgentRegistry,
    Chunk,
    EgressOpened,
    EgressResult,
    EgressTrust,
    EgressTrustResult,
    ServerStream,
    StreamError,
    StreamLost,
    TooManyStreams,
)
from agentic_sandbox.broker.egress.service import EgressService, Requester
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

TRUST_KIND = "egress_trust"
# a file write and a rename in the guest; generous for a TCG guest on a loaded host (the record
# says `failed` past it, though the agent finishes the install)
TRUST_TIMEOUT = 120.0


class StreamPipe:
    """An egress stream's channel 0 as the proxy's `Pipe`."""

    def __init__(self, stream: ServerStream) -> None:
        self._stream = stream
        self._eof = False

    async def read(self) -> bytes:
        while not self._eof:
            chunk: Chunk | None = await self._stream.read()
            if chunk is None:
                self._eof = True
                break
            if chunk.channel != 0:
                continue
            self._eof = chunk.eof
            if chunk.data:
                return chunk.data
        return b""

    async def write(self, data: bytes) -> None:
        await self._stream.write(0, data)

    async def end(self) -> None:
        with contextlib.suppress(StreamError):
            await self._stream.end(0)


class EgressComponent:
    name = "egress"

    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.svc = svc
        self.service = EgressService(svc)
        registry.stream_acceptors["egress"] = self._accept
        registry.listeners.append(self._on_agent)
        self.registry = registry
        self.service.on_new_ca = self._new_ca
        svc.incarnations.on_end("egress", self._ended)
        self._pushes: set[asyncio.Task[None]] = set()

    # ---- the CA to the guest --------------------------------------------------------------------
    def _on_agent(self, conn: AgentConnection, state: str) -> None:
        if state != "registered" or TRUST_KIND not in conn.info.stream_kinds:
            return
        task = asyncio.ensure_future(self._push_trust(conn))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)

    def _new_ca(self, instance_id: str, incarnation: str) -> None:
        """A credential change made a new CA: to the guest now (not at its next registration)."""
        conn = self.registry.get(instance_id)
        if conn is None or conn.incarnation != incarnation or not conn.ready:
            return  # its next registration sends the current one
        self._on_agent(conn, "registered")

    async def _push_trust(self, conn: AgentConnection) -> None:
        ca = await self.service.current_ca(conn.instance_id, conn.incarnation, renew=True)
        data: dict[str, object] = {
            "incarnation": conn.incarnation,
            "link_id": conn.id,
            "fingerprint": ca.fingerprint,
            "not_after": ca.not_after.isoformat(),
        }
        try:
            stream = conn.streams.open(EgressTrust(ca_pem=ca.certificate_pem))
            stream.expire_at(asyncio.get_running_loop().time() + TRUST_TIMEOUT)
            result = await stream.result()
        except (StreamError, StreamLost, TooManyStreams) as exc:
            data["error"] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("the egress CA did not reach %s: %s", conn.instance_id, data["error"])
            self.svc.events.publish(
                "egress.ca.failed",
                actor=f"agent:{conn.instance_id}",
                instance_id=conn.instance_id,
                owner=conn.owner or None,
                data=data,
            )
            return
        except Exception as exc:  # a link that closed under us: nothing to tell anyone
            log.info("egress CA push to %s ended: %s", conn.instance_id, exc)
            return
        if isinstance(result, EgressTrustResult):
            data["path"], data["refreshed"] = result.path[:256], result.refreshed
        self.svc.events.publish(
            "egress.ca.installed",
            actor=f"agent:{conn.instance_id}",
            instance_id=conn.instance_id,
            owner=conn.owner or None,
            data=data,
        )

    async def _ended(self, ended: EndedIncarnation) -> None:
        self.service.end_incarnation(ended.instance_id, ended.incarnation)

    async def _accept(
        self, conn: AgentConnection, stream: ServerStream, spec: EgressOpened
    ) -> None:
        conn.streams.accept(stream, spec)
        who = Requester(conn.instance_id, conn.incarnation, conn.owner, spec.client[:128])
        try:
            out = await self.service.serve(StreamPipe(stream), who)
        except StreamError:
            return  # the link or the stream went away (the attempt is recorded by serve)
        conn.streams.finish(
            stream,
            EgressResult(
                bytes_up=out.bytes_up,
                bytes_down=out.bytes_down,
                verdict=out.verdict,
                reason=out.reason,
            ),
        )

    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.egress import routes

        app[routes.EGRESS_KEY] = self.service
        routes.api.install(app)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for task in list(self._pushes):
            task.cancel()
        await asyncio.gather(*self._pushes, return_exceptions=True)
