"""An in-process session hub with the real parts around it, for fast tests of its insides.

`hub_server(tmp_path)` starts the server's foundation (SQLite, events, audit, vault, HTTP) with
the sessions and agent-link components, in this process. Nothing under test is replaced:

- `LinkedAgent` is this test speaking as an agent at the agent link's edge: a real
  `AgentConnection` in the real registry, whose commands from the hub (`open`, `input`,
  `resize`, `signal`, `close`, `ack`) are read from its outbox, and whose reports go to the
  hub's `LinkHandler` methods as the typed values the gRPC service would hand it;
- `Screenless` is a client transport that keeps what a client was sent (the other edge: what
  the attach WebSocket would write), driven by the real client writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentic_sandbox.broker.agentlink import (
    AgentConnection,
    AgentLinkComponent,
    AgentRegistry,
    Exited,
    ExitReport,
    Inventory,
    Opened,
    Output,
    Reconciled,
)
from agentic_sandbox.broker.app import Component
from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.observability.events import Event
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.sessions.clients import AttachedClient
from agentic_sandbox.broker.sessions.component import SessionsComponent
from agentic_sandbox.broker.sessions.contract import SessionSpec
from agentic_sandbox.broker.sessions.hub import SessionHub
from agentic_sandbox.broker.sessions.ring import unpack_frame
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.proto import agent_pb2 as pb
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.polling import until as until  # re-exported: hub tests import it here


def principal(subject: str, role: Role = Role.operator) -> Principal:
    return Principal(subject=subject, role=role, kind="token", credential_id=f"id-{subject}")


@dataclass
class HubServer:
    running: Running
    hub: SessionHub
    registry: AgentRegistry
    events: list[Event] = field(default_factory=list)

    @property
    def svc(self) -> Services:
        return self.running.svc

    def metric(self, name: str, **labels: str) -> float:
        return self.svc.metrics.registry.get_sample_value(name, labels) or 0.0

    def published(self, type_: str) -> list[Event]:
        return [ev for ev in self.events if ev.type == type_]

    async def instance(self, instance_id: str) -> str:
        """A host-agent instance owned by the admin; its incarnation."""
        status, body, _ = await self.running.call(
            "POST", "/api/v2/admin/agents/host-instances", json={"instance_id": instance_id}
        )
        assert status == 201, body
        return str(body["incarnation"])

    async def secret(self, name: str, value: str, instance_id: str) -> None:
        status, body, _ = await self.running.call(
            "PUT",
            f"/api/v2/admin/secrets/{name}",
            json={"value": value, "instances": [instance_id]},
        )
        assert status in (200, 201), body

    async def agent(self, instance_id: str, *, register: bool = True) -> LinkedAgent:
        """The agent of a new instance; registered with nothing to reconcile, by default."""
        incarnation = await self.instance(instance_id)
        agent = LinkedAgent(self.hub, self.registry, instance_id, incarnation)
        if register:
            await agent.register()
        return agent

    async def session(
        self, instance_id: str, secrets: dict[str, str] | None = None
    ) -> tuple[LinkedAgent, HubSession]:
        """A running session (a shell, owned by the admin) on the agent of a new instance,
        with these secrets (name -> value) bound to the instance before it opens."""
        agent = await self.agent(instance_id)
        for name, value in (secrets or {}).items():
            await self.secret(name, value, instance_id)
        sid = await agent.open(SessionSpec(instance_id=instance_id, owner="admin", command=["sh"]))
        sess = self.hub.get(sid)
        assert sess is not None
        return agent, sess


@contextlib.asynccontextmanager
async def hub_server(tmp_path: Path, **settings: Any) -> AsyncIterator[HubServer]:
    made: dict[str, Any] = {}

    def components(svc: Services) -> list[Component]:
        sessions = SessionsComponent(svc)
        link = AgentLinkComponent(svc, handler=sessions.hub)
        sessions.hub.use_registry(link.registry)
        made["hub"], made["registry"] = sessions.hub, link.registry
        return [sessions, link]

    async with start_server(make_settings(tmp_path, **settings), components) as running:
        server = HubServer(running, made["hub"], made["registry"])
        running.svc.events.add_listener(server.events.append)
        yield server


class LinkedAgent:
    """This test as the agent of one instance (see the module note)."""

    def __init__(
        self, hub: SessionHub, registry: AgentRegistry, instance_id: str, incarnation: str
    ) -> None:
        self.hub = hub
        self.registry = registry
        self.conn = AgentConnection(
            instance_id=instance_id,
            incarnation=incarnation,
            owner="admin",
            cert_serial="in-process",
            cert_not_after=dt.datetime.now(dt.UTC) + dt.timedelta(days=1),
            peer="in-process",
        )
        self.received: asyncio.Queue[pb.ServerMessage] = asyncio.Queue()
        self._pump = asyncio.create_task(self._read_outbox())

    async def _read_outbox(self) -> None:
        async for msg in self.conn.outgoing():
            await self.received.put(msg)

    async def register(self, inventory: Sequence[Inventory] = ()) -> Reconciled:
        self.registry.attach(self.conn)
        answer = await self.hub.on_register(self.conn, list(inventory))
        self.conn.registered = True
        return answer

    async def command(self, kind: str, timeout: float = 5.0) -> pb.ServerMessage:
        """The next command of this kind the hub sent (others before it are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = await asyncio.wait_for(self.received.get(), deadline - time.monotonic())
            if msg.WhichOneof("body") == kind:
                return msg

    async def commands(self, settle: float = 0.1) -> list[pb.ServerMessage]:
        """Every command sent until none came for `settle` seconds."""
        out: list[pb.ServerMessage] = []
        while True:
            try:
                out.append(await asyncio.wait_for(self.received.get(), settle))
            except TimeoutError:
                return out

    async def open(self, spec: SessionSpec) -> str:
        """Create a session through the hub's contract, answering the open as an agent does."""
        created = asyncio.create_task(self.hub.create(spec, actor="test"))
        msg = await self.command("open")
        self.hub.on_opened(self.conn, Opened(msg.open.session_id, ok=True, pid=4242))
        return await created

    def output(self, session_id: str, offset: int, data: bytes) -> None:
        self.hub.on_output(self.conn, Output(session_id, offset, data))

    def exit(self, session_id: str, end_offset: int, code: int | None = 0) -> None:
        self.hub.on_exit(self.conn, Exited(session_id, end_offset, ExitReport(code=code)))

    async def close(self) -> None:
        self.conn.close("test done")
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        self.hub.on_disconnect(self.conn)
        self.registry.detach(self.conn)


class Screenless:
    """A client transport that keeps what it was sent."""

    def __init__(self) -> None:
        self.texts: list[dict[str, Any]] = []
        self.frames: list[tuple[int, bytes]] = []
        self.closed: tuple[int, str] | None = None

    async def send_text(self, text: str) -> None:
        self.texts.append(json.loads(text))

    async def send_binary(self, data: bytes) -> None:
        self.frames.append(unpack_frame(data))

    async def close(self, code: int, message: str) -> None:
        self.closed = (code, message)

    def abort(self) -> None:
        self.closed = (1006, "aborted")

    def backed_up(self) -> bool:
        return False  # it takes everything at once

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [t for t in self.texts if t["type"] == type_]

    def output(self) -> bytes:
        """The output bytes, checked to be contiguous."""
        data = b""
        for offset, payload in self.frames:
            assert not data or offset == self.frames[0][0] + len(data), self.frames
            data += payload
        return data


def attach(
    hub: SessionHub,
    sess: HubSession,
    who: Principal,
    *,
    want_control: bool = False,
    may_control: bool = False,
    from_offset: int | None = 0,
) -> tuple[AttachedClient, Screenless]:
    """A client attached as the WebSocket handler attaches one, its writer running."""
    transport = Screenless()
    client = hub.control.attach(
        sess,
        who,
        transport,
        want_control=want_control,
        may_control=may_control,
        from_offset=from_offset,
    )
    client.task = asyncio.create_task(client.run())
    return client, transport
