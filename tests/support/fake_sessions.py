"""An in-process SessionService for unit tests of the task layer (never used by integration).

Each session is driven by the test (`emit`, `exit`, `prompt`) or by a small script keyed by
the session's argv: `script(argv) -> async callable(session)`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    BudgetSupport,
    ExitStatus,
    OutputChunk,
    Prompt,
    PromptListener,
    SessionEnded,
    SessionNotFound,
    SessionSpec,
)


@dataclass
class FakeSession:
    id: str
    spec: SessionSpec
    output: bytearray = field(default_factory=bytearray)
    inputs: list[bytes] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    status: ExitStatus | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    input_arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def _poke(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


Script = Callable[["FakeSessions", FakeSession], Awaitable[None]]


class FakeSessions:
    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.sessions: dict[str, FakeSession] = {}
        self.listeners: list[PromptListener] = []
        self.scripts: dict[str, Script] = {}
        self.ignore_term = False
        self.unavailable_follow = 0  # follow_output raises AgentUnavailable this many times
        self.chunk = 1 << 30
        self.open_gate: asyncio.Event | None = None  # set: `create` waits for it (a slow open)
        self.opening = asyncio.Event()  # a `create` has begun
        # what the fake agents enforce (a host agent without cgroups by default)
        self.support = BudgetSupport("none", ("timeout", "output_bytes"), "no cgroups here")
        self._running: set[asyncio.Future[None]] = set()

    # ---- test controls --------------------------------------------------------------------
    def emit(self, sid: str, data: bytes) -> None:
        s = self.sessions[sid]
        s.output.extend(data)
        s._poke()

    def exit(self, sid: str, code: int | None = 0, signal: str | None = None, **kw: object) -> None:
        s = self.sessions[sid]
        if s.status is None:
            s.status = ExitStatus(code=code, signal=signal, **kw)  # type: ignore[arg-type]
            s.exited.set()
            s._poke()

    def prompt(self, sid: str, text: str) -> None:
        s = self.sessions[sid]
        for fn in self.listeners:
            fn(Prompt(session_id=sid, text=text, offset=len(s.output)))

    def only(self) -> FakeSession:
        assert len(self.sessions) == 1, self.sessions
        return next(iter(self.sessions.values()))

    async def wait_session(self, n: int = 1) -> list[FakeSession]:
        for _ in range(500):
            if len(self.sessions) >= n:
                return list(self.sessions.values())
            await asyncio.sleep(0.01)
        raise AssertionError(f"{n} sessions never opened")

    # ---- contract -------------------------------------------------------------------------
    def agent_ready(self, instance_id: str) -> bool:
        return instance_id in self.ready

    def budget_support(self, instance_id: str) -> BudgetSupport | None:
        return self.support if instance_id in self.ready else None

    async def create(self, spec: SessionSpec, *, actor: str) -> str:
        if spec.instance_id not in self.ready:
            raise AgentUnavailable(f"agent {spec.instance_id} is not connected")
        self.opening.set()
        if self.open_gate is not None:
            await self.open_gate.wait()
        sid = str(uuid.uuid4())
        s = FakeSession(sid, spec)
        self.sessions[sid] = s
        key = spec.command[-1] if spec.command else ""
        script = self.scripts.get(key)
        if script is not None:
            task = asyncio.ensure_future(script(self, s))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return sid

    async def write(self, session_id: str, data: bytes, *, actor: str) -> None:
        s = self._get(session_id)
        if s.status is not None:
            raise SessionEnded(session_id)
        s.inputs.append(data)
        s.input_arrived.set()

    async def signal(self, session_id: str, signal: str, *, actor: str) -> None:
        s = self._get(session_id)
        if s.status is not None:
            raise SessionEnded(session_id)
        s.signals.append(signal)
        if signal == "KILL" or (signal == "TERM" and not self.ignore_term):
            self.exit(session_id, None, signal)

    async def kill(self, session_id: str, *, actor: str) -> None:
        await self.signal(session_id, "KILL", actor=actor)

    async def follow_output(
        self, session_id: str, from_offset: int = 0
    ) -> AsyncIterator[OutputChunk]:
        if self.unavailable_follow > 0:
            self.unavailable_follow -= 1
            raise AgentUnavailable("agent not back yet")
        s = self._get(session_id)
        pos = from_offset
        while True:
            if pos < len(s.output):
                end = min(len(s.output), pos + self.chunk)
                yield OutputChunk(pos, bytes(s.output[pos:end]))
                pos = end
                continue
            if s.status is not None:
                return
            await s.changed.wait()

    async def wait_exit(self, session_id: str) -> ExitStatus:
        s = self._get(session_id)
        await s.exited.wait()
        assert s.status is not None
        return s.status

    def add_prompt_listener(self, listener: PromptListener) -> None:
        self.listeners.append(listener)

    def _get(self, sid: str) -> FakeSession:
        try:
            return self.sessions[sid]
        except KeyError:
            raise SessionNotFound(sid) from None
