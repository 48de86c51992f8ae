"""The task layer on a real SQLite store with an in-process fake session layer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox.broker.app import build_services, close_services
from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks import Caller, TaskRecord, TasksComponent, TaskService, TaskState
from tests.support.fake_sessions import FakeSessions

ALICE = Caller(subject="alice", actor="token:alice")
BOB = Caller(subject="bob", actor="token:bob")

GREET_SKILL = {
    "id": "greet",
    "name": "Greet",
    "description": "Says hello to someone",
    "tags": ["demo"],
    "input_schema": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1}, "times": {"type": "integer"}},
        "additionalProperties": False,
    },
    "command": ["greet", "{data}"],
}


@dataclass
class Env:
    svc: Services
    tasks: TaskService
    fake: FakeSessions
    component: TasksComponent

    async def add_instance(self, iid: str = "vm1", owner: str = "alice", **spec: Any) -> None:
        async with self.svc.db.session() as s:
            s.add(m.Instance(id=iid, owner=owner, state="running", spec=spec))
        self.fake.ready.add(iid)

    async def submit(
        self, text: str = "echo hi", *, caller: Caller = ALICE, iid: str = "vm1", **msg: Any
    ) -> TaskRecord:
        message = {"messageId": msg.pop("messageId", None) or _mid(), "role": "ROLE_USER"}
        message["parts"] = msg.pop("parts", None) or [{"text": text}]
        message.update(msg)
        return await self.tasks.submit(instance_id=iid, caller=caller, message=message)

    async def until(self, task_id: str, *states: TaskState, seconds: float = 5) -> TaskRecord:
        for _ in range(int(seconds * 100)):
            rec = await self.tasks.get(task_id, Caller("x", "x", is_admin=True))
            if rec.state in states:
                return rec
            await asyncio.sleep(0.01)
        raise AssertionError(f"task {task_id} stayed {rec.state}, wanted {states}")


_n = 0


def _mid() -> str:
    global _n
    _n += 1
    return f"msg-{_n}"


def settings_for(tmp_path: Path, **over: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "libvirt_uri": "",
        "task_output_flush_seconds": 0.01,
        "task_cancel_grace_seconds": 0.3,
        "task_recovery_grace_seconds": 1.0,
        "push_backoff_initial_seconds": 0.01,
        "push_backoff_max_seconds": 0.05,
        # the tests' webhook receivers listen on loopback, which is refused unless allowed
        "push_allow_networks": ["127.0.0.1/32"],
    }
    values.update(over)
    return Settings(**values)


@pytest.fixture
async def env(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    over = getattr(request, "param", {}) or {}
    async with running_env(settings_for(tmp_path, **over)) as e:
        yield e


class running_env:
    def __init__(self, settings: Settings, fake: FakeSessions | None = None) -> None:
        self.settings = settings
        self.fake = fake or FakeSessions()

    async def __aenter__(self) -> Env:
        self.svc = await build_services(self.settings)
        self.component = TasksComponent(self.svc, sessions=self.fake)
        await self.component.start()
        return Env(self.svc, self.component.service, self.fake, self.component)

    async def __aexit__(self, *exc: object) -> None:
        await self.component.stop()
        await close_services(self.svc)


# ---- an in-process server with the A2A surface over the fake session layer -----------------
@dataclass
class Agent:
    base: str  # http://127.0.0.1:port
    url: str  # the agent URL of instance vm1
    admin: str  # admin token
    svc: Services
    fake: FakeSessions
    tasks: TaskService

    async def key(self, scopes: list[str], instance_id: str = "vm1", owner: str = "alice") -> str:
        issued = await self.svc.auth.create_api_key(
            instance_id=instance_id, owner=owner, scopes=frozenset(scopes)
        )
        return issued.secret

    async def token(self, subject: str, role: str = "operator") -> str:
        from agentic_sandbox.broker.auth.principal import Role

        issued = await self.svc.auth.create_token(subject=subject, role=Role(role), created_by=None)
        return issued.secret

    async def add_instance(self, iid: str = "vm1", owner: str = "alice", **spec: Any) -> None:
        async with self.svc.db.session() as s:
            s.add(m.Instance(id=iid, owner=owner, state="running", spec=spec))
        self.fake.ready.add(iid)


def install_scripts(fake: FakeSessions) -> None:
    async def hello(f: FakeSessions, s: Any) -> None:
        await asyncio.sleep(0.02)
        f.emit(s.id, b"hello\r\n")
        f.exit(s.id, 0)

    async def ticks(f: FakeSessions, s: Any) -> None:
        for i in range(3):
            f.emit(s.id, f"tick {i}\r\n".encode())
            await asyncio.sleep(0.3)
        f.exit(s.id, 0)

    async def ask(f: FakeSessions, s: Any) -> None:
        f.emit(s.id, b"Continue? (y/n) ")
        await asyncio.sleep(0.05)
        f.prompt(s.id, "Continue? (y/n)")
        await s.input_arrived.wait()
        f.emit(s.id, b"y\r\nyou said " + s.inputs[0].strip() + b"\r\n")
        f.exit(s.id, 0)

    async def ask_at_once(f: FakeSessions, s: Any) -> None:
        # the prompt comes before the task's `working` transition is stored
        f.emit(s.id, b"Sure? (y/n) ")
        f.prompt(s.id, "Sure? (y/n)")
        await s.input_arrived.wait()
        f.emit(s.id, b"you said " + s.inputs[0].strip() + b"\r\n")
        f.exit(s.id, 0)

    async def fail(f: FakeSessions, s: Any) -> None:
        f.exit(s.id, 7)

    fake.scripts.update(
        {"echo hello": hello, "ticks": ticks, "ask": ask, "ask now": ask_at_once, "exit 7": fail}
    )


@pytest.fixture
async def agent(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Agent]:
    from agentic_sandbox.broker.a2a import A2AComponent
    from agentic_sandbox.broker.server import Server
    from tests.support.inproc_server import free_port

    over = getattr(request, "param", {}) or {}
    port = free_port()
    settings = settings_for(
        tmp_path,
        http_listen=f"127.0.0.1:{port}",
        grpc_listen=f"127.0.0.1:{free_port()}",
        grpc_enroll_listen=f"127.0.0.1:{free_port()}",
        metrics_listen=f"127.0.0.1:{free_port()}",
        guest_link_listen=f"127.0.0.1:{free_port()}",
        log_format="text",
        **over,
    )
    fake = FakeSessions()
    install_scripts(fake)
    holder: dict[str, TaskService] = {}

    def factory(svc: Services) -> list[Any]:
        tasks = TasksComponent(svc, sessions=fake)
        holder["tasks"] = tasks.service
        return [tasks, A2AComponent(svc, tasks.service)]

    server = Server(settings, component_factory=factory)
    svc = await server.start()
    base = f"http://127.0.0.1:{port}"
    ag = Agent(
        base=base,
        url=f"{base}/agents/vm1",
        admin=settings.effective_admin_token_file.read_text().strip(),
        svc=svc,
        fake=fake,
        tasks=holder["tasks"],
    )
    await ag.add_instance(skills=[GREET_SKILL])
    try:
        yield ag
    finally:
        await server.stop()
