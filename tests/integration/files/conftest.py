"""Files-tier fixtures: a real server subprocess and a real host agent-client for the module."""

from collections.abc import Iterator

import pytest

from tests.support.agents import AgentProcess, start_agent
from tests.support.fixtures import agent_factory, sandbox_server, server_factory, unique_id
from tests.support.server import ServerProcess

__all__ = ["agent", "agent_factory", "sandbox_server", "server_factory"]


@pytest.fixture(scope="module")
def agent(
    sandbox_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentProcess]:
    proc = start_agent(sandbox_server, unique_id("x1-files"), tmp_path_factory.mktemp("agents"))
    yield proc
    proc.stop()
