"""The egress component: the proxy behind every `allowlist` guest and its admin routes."""

from __future__ import annotations

import contextlib

from aiohttp import web

from agentic_sandbox.broker.agentlink import (
    AgentConnection,
    AgentRegistry,
    Chunk,
    EgressOpened,
    EgressResult,
    ServerStream,
    StreamError,
)
from agentic_sandbox.broker.egress.service import EgressService, Requester
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.services import Services


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
        self.service = EgressService(svc)
        registry.stream_acceptors["egress"] = self._accept
        svc.incarnations.on_end("egress", self._ended)

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
        return None
