"""The `SessionService` contract as the task layer uses it (in-process server, real agent).

create / write / signal / kill / follow_output / wait_exit / add_prompt_listener / agent_ready.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.server import Server
from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    OutputChunk,
    Prompt,
    SessionEnded,
    SessionNotFound,
    SessionService,
    SessionSpec,
)
from agentic_sandbox.broker.sessions.hub import SessionStartFailed
from agentic_sandbox.broker.store import models as m
from tests.support.agents import AgentProcess
from tests.support.server import free_port

pytestmark = pytest.mark.timeout(120)


async def _until(pred: object, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def test_session_service_contract(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        http_listen=f"127.0.0.1:{free_port()}",
        grpc_listen=f"127.0.0.1:{free_port()}",
        grpc_enroll_listen=f"127.0.0.1:{free_port()}",
        guest_link_listen=f"127.0.0.1:{free_port()}",
        metrics_listen=f"127.0.0.1:{free_port()}",
        libvirt_uri="",
        agent_heartbeat_seconds=0.5,
        session_hitl_quiet_ms=150,
    )
    server = Server(settings)
    svc = await server.start()
    agent: AgentProcess | None = None
    try:
        sessions = next(c for c in server.components if c.name == "sessions")
        hub: SessionService = sessions.hub  # type: ignore[attr-defined]  # seen as the contract
        async with svc.db.session() as s:
            s.add(m.Instance(id="contract-1", owner="alice", state="running", spec={}))
            s.add(m.Instance(id="contract-2", owner="alice", state="running", spec={}))
        link = next(c for c in server.components if c.name == "agent-link")
        issued = await link.enrollment.create_token(  # type: ignore[attr-defined]
            "contract-1", dt.timedelta(minutes=5)
        )
        shim = SimpleNamespace(
            grpc_target=settings.grpc_listen,
            enroll_target=settings.grpc_enroll_listen,
            ca_path=settings.data_dir / "agent-ca" / "ca.crt",
        )
        agent = AgentProcess(
            shim,  # type: ignore[arg-type]
            "contract-1",
            tmp_path / "agent",
            enrollment_token=issued.token,
        ).start()
        await _until(lambda: hub.agent_ready("contract-1"), 30, "agent ready")
        assert not hub.agent_ready("contract-2")

        with pytest.raises(AgentUnavailable):
            await hub.create(SessionSpec(instance_id="contract-2", owner="alice"), actor="t")
        with pytest.raises(SessionNotFound):
            hub.follow_output("no-such-session")

        prompts: list[Prompt] = []
        hub.add_prompt_listener(prompts.append)
        sid = await hub.create(
            SessionSpec(
                instance_id="contract-1",
                owner="alice",
                command=["bash", "--norc", "--noprofile"],
                env={"PS1": "$ "},
                name="task run",
                task_id="11111111-2222-3333-4444-555555555555",
            ),
            actor="task:test",
        )
        got = bytearray()
        chunks: list[OutputChunk] = []

        async def follow() -> None:
            async for chunk in hub.follow_output(sid, 0):
                assert chunk.offset == len(got), "follow_output skipped or repeated bytes"
                chunks.append(chunk)
                got.extend(chunk.data)

        follower = asyncio.create_task(follow())
        await hub.write(sid, b"read -p 'Proceed? (y/n) ' x; echo answer-$x\n", actor="task:test")
        await _until(lambda: prompts, 15, "a prompt")
        assert prompts[0].session_id == sid and "(y/n)" in prompts[0].text
        assert prompts[0].offset <= len(got) + 4096
        await hub.write(sid, b"y\n", actor="task:test")
        await _until(lambda: b"answer-y" in got, 15, "the answer's echo")

        # A second follower from a later offset gets exactly the bytes from there.
        later = len(got) - 5
        first_chunk = await anext(aiter(hub.follow_output(sid, later)))
        assert first_chunk.offset == later and bytes(got[later:]).startswith(first_chunk.data[:5])

        await hub.write(sid, b"sleep 30\n", actor="task:test")
        await asyncio.sleep(0.3)
        await hub.signal(sid, "INT", actor="task:test")  # Ctrl-C to the foreground job
        await hub.write(sid, b"echo still-here; exit 4\n", actor="task:test")
        status = await asyncio.wait_for(hub.wait_exit(sid), 20)
        assert status.code == 4 and status.signal is None and not status.lost
        await asyncio.wait_for(follower, 10)  # the iterator ends with the session
        assert b"still-here" in got
        with pytest.raises(SessionEnded):
            await hub.write(sid, b"x", actor="task:test")
        assert (await hub.wait_exit(sid)).code == 4

        sid2 = await hub.create(
            SessionSpec(instance_id="contract-1", owner="alice", command=["sleep", "600"]),
            actor="task:test",
        )
        await hub.kill(sid2, actor="task:test")
        status2 = await asyncio.wait_for(hub.wait_exit(sid2), 20)
        assert status2.signal in ("HUP", "KILL") and status2.code is None

        # The agent makes a session's directories before it starts it (a task's outbox) ...
        outbox = tmp_path / "work" / "t1" / "outbox"
        sid3 = await hub.create(
            SessionSpec(
                instance_id="contract-1",
                owner="alice",
                command=["bash", "-c", 'test "$PWD" = "$0" && exit 7', str(outbox.parent)],
                cwd=str(outbox.parent),
                make_dirs=(str(outbox),),
            ),
            actor="task:test",
        )
        assert (await asyncio.wait_for(hub.wait_exit(sid3), 20)).code == 7 and outbox.is_dir()
        # ... and one that does not say it does (an older agent) is not sent them
        conn = link.registry.get("contract-1")  # type: ignore[attr-defined]
        conn.info.session_dirs = False
        with pytest.raises(SessionStartFailed, match="does not make a session's directories"):
            await hub.create(
                SessionSpec(
                    instance_id="contract-1",
                    owner="alice",
                    command=["true"],
                    make_dirs=(str(tmp_path / "never"),),
                ),
                actor="task:test",
            )
        assert not (tmp_path / "never").exists()
    finally:
        if agent is not None:
            agent.stop()
        await server.stop()
