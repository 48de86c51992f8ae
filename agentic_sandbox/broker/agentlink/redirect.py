"""A follower's agent-link listeners: every rpc is refused, naming the leader.

Several control hosts share one PostgreSQL; only the leader holds agent links (it owns the
sessions, the scheduler and the event sequence). A follower still listens on its agent-link
addresses, with the same TLS as the leader (the shared CA: a client certificate is required on
the link port, as on the leader), and answers `Enroll`, `Renew` and `Connect` with
`UNAVAILABLE` and the trailing metadata `sandbox-leader: <node> <agent-link address>`
(`proto.LEADER_METADATA`). An agent given every control address dials that one next
(`agent/controls.py`); while nobody leads, the answer names nobody and the agent tries its next
address. The follower never relays a link: a link is the leader's, whole.

When the node is elected, these listeners stop before the leader's service binds the same
addresses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc

from agentic_sandbox.broker.cluster import Leadership
from agentic_sandbox.proto import LEADER_METADATA
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["AgentLink"]


async def release_ports(server: grpc.aio.Server) -> None:
    """Let go of the ports a server that never started has bound: `add_*_port` binds at once,
    and only a started server's stop closes its sockets (not a stop before the start, not the
    garbage collector). A bind that failed half-way would otherwise keep the other port until
    the process ends (a follower elected later could not listen on it)."""
    with contextlib.suppress(Exception):
        await server.start()
    await server.stop(grace=None)


Bind = Callable[[grpc.aio.Server], dict[str, int]]  # binds the agent-link listeners


class _Refusals(grpc.GenericRpcHandler):
    """Every AgentLink method: `UNAVAILABLE`, naming the leader when one is known."""

    def __init__(self, cluster: Leadership) -> None:
        self._cluster = cluster
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        for m in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{m.name}"
            if m.client_streaming and m.server_streaming:
                handler = grpc.stream_stream_rpc_method_handler(self._refuse_stream)
            elif not m.client_streaming and not m.server_streaming:
                handler = grpc.unary_unary_rpc_method_handler(self._refuse)
            else:  # the service has no half-streaming methods; one added gets its kind here
                raise TypeError(f"{path}: a half-streaming method has no refusal yet")
            self._handlers[path] = handler

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        return self._handlers.get(handler_call_details.method)

    async def _refuse(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await self._abort(context)

    async def _refuse_stream(
        self, requests: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await self._abort(context)

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Raises (`context.abort` ends the rpc with the status)."""
        me, leader = self._cluster.me.node, self._cluster.leader
        if leader is None or leader.node == me or not leader.grpc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"control host {me} does not lead and no node leads right now; retry",
            )
        else:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"control host {me} is a follower; {leader.node} leads at {leader.grpc}",
                trailing_metadata=((LEADER_METADATA, f"{leader.node} {leader.grpc}"),),
            )


class FollowerLink:
    """The follower's gRPC server on the agent-link listeners."""

    def __init__(self, cluster: Leadership) -> None:
        self._cluster = cluster
        self._server: grpc.aio.Server | None = None

    async def start(self, bind: Bind) -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([_Refusals(self._cluster)])
        try:
            ports = bind(server)
        except Exception:
            await release_ports(server)  # else the port bound first stays the leader's loss
            raise
        await server.start()
        self._server = server
        log.info("agent-link listeners refer agents to the leader", extra={"ports": ports})

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=None)
