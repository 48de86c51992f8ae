"""Agent liveness: a silent agent goes stale (and back), a restarted agent loses its sessions,
which the server marks lost when the agent re-registers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.fixtures import AgentFactory
from tests.support.server import ServerProcess
from tests.support.sessions import SHELL, create_session, events, wait_state

pytestmark = pytest.mark.timeout(120)


def _agent_state(server: ServerProcess, instance_id: str) -> str:
    return str(server.ok("GET", f"/api/v2/admin/agents/{instance_id}")["state"])


def _wait_agent(server: ServerProcess, instance_id: str, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _agent_state(server, instance_id) != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent {instance_id} never became {state}")
        time.sleep(0.1)


def test_silent_agent_goes_stale_then_ready(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server  # heartbeats every 0.5 s here: stale after 1.5 s of silence
    agent = agent_factory(server)
    worker = agent.worker_pid()  # the agent proper (its keeper only holds the PTYs)
    os.kill(worker, signal.SIGSTOP)
    try:
        _wait_agent(server, agent.instance_id, "stale", 10)
        code, problem = server.api(
            "POST", "/api/v2/admin/sessions", {"instance_id": agent.instance_id}
        )
        assert code == 503, problem  # a stale agent is not ready
    finally:
        os.kill(worker, signal.SIGCONT)
    _wait_agent(server, agent.instance_id, "connected", 10)
    assert events(server, "agent.stale", instance_id=agent.instance_id)
    create_session(server, agent.instance_id, ["true"])


def test_restarted_agent_sessions_are_marked_lost(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    agent.kill9()  # its PTYs hang up with it
    _wait_agent(server, agent.instance_id, "disconnected", 10)
    assert server.ok("GET", f"/api/v2/admin/sessions/{sid}")["state"] == "running"
    agent.start()  # enrolled already: the same certificate, a new process
    agent.wait_connected(since=time.time() - 1)
    info = wait_state(server, sid, ("lost",))
    assert "no longer has" in info["exit_reason"]
    assert events(server, "session.lost", session_id=sid)
