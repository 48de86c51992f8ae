"""Reusable pytest fixtures: a real server subprocess and real agent-client processes.

Registered for every tier by `tests/conftest.py` (`pytest_plugins`).

- `server_factory(**env)` starts a `ServerProcess` (stopped at teardown); `sandbox_server`
  is one per test module with test-friendly settings.
- `agent_factory(server, instance_id)` registers a host instance, enrolls and starts an
  agent-client, and waits until the server reports it connected.

A failing test's report carries the last lines of every server subprocess still running (an
e2e failure in CI is otherwise only its assertion: the link closes and their reasons are there).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.agents import AgentProcess, start_agent
from tests.support.server import ServerProcess, running_servers

# Settings that keep tests fast; a test may override any of them.
TEST_SERVER_ENV = {
    "SANDBOX_AGENT_HEARTBEAT_SECONDS": "0.5",
    "SANDBOX_SESSION_CLIENT_STALL_SECONDS": "3",
    "SANDBOX_SESSION_HITL_QUIET_MS": "200",
    "SANDBOX_SESSION_KILL_GRACE_SECONDS": "1",
    "SANDBOX_RATE_LIMIT_PER_MINUTE": "100000",
    "SANDBOX_RATE_LIMIT_BURST": "10000",
}

_ids = itertools.count(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call" and report.failed:
        for server in running_servers():
            title = f"sandbox-server log, last 80 lines ({server.log_path})"
            report.sections.append((title, server.log_tail(80)))


def unique_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid() % 10000}-{next(_ids)}"


ServerFactory = Callable[..., ServerProcess]
AgentFactory = Callable[..., AgentProcess]


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    servers: list[ServerProcess] = []

    def make(**env: str) -> ServerProcess:
        merged = {**TEST_SERVER_ENV, **env}
        server = ServerProcess(tmp_path / f"server-{len(servers) + 1}", env=merged)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def sandbox_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("sandbox-server"), env=dict(TEST_SERVER_ENV))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[AgentFactory]:
    agents: list[AgentProcess] = []

    def make(server: ServerProcess, instance_id: str | None = None, **kw: object) -> AgentProcess:
        agent = start_agent(server, instance_id or unique_id("agent"), tmp_path, **kw)  # type: ignore[arg-type]
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.stop()
