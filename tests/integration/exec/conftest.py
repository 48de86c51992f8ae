"""Exec-tier fixtures: a real server subprocess and real agent-client processes (as root, on
this machine's cgroups); `agent` is one host agent for a whole module."""

from collections.abc import Iterator

import pytest

from tests.support.agents import AgentProcess, start_agent
from tests.support.fixtures import unique_id
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def agent(
    sandbox_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentProcess]:
    proc = start_agent(sandbox_server, unique_id("x1-exec"), tmp_path_factory.mktemp("agents"))
    yield proc
    proc.stop()
