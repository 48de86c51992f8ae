"""Ports-tier fixtures: a real server subprocess, a real host agent-client for the module, and
a loopback HTTP/WebSocket server beside it (what the guest's dev server plays)."""

from collections.abc import Iterator

import pytest

from tests.support.agents import AgentProcess, start_agent
from tests.support.fixtures import agent_factory, sandbox_server, server_factory, unique_id
from tests.support.server import ServerProcess
from tests.support.upstream import Upstream

__all__ = ["agent", "agent_factory", "sandbox_server", "server_factory", "upstream"]


@pytest.fixture(scope="module")
def agent(
    sandbox_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentProcess]:
    proc = start_agent(sandbox_server, unique_id("x1-ports"), tmp_path_factory.mktemp("agents"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up
