"""Security tier fixtures: real server subprocesses and real agent-client processes."""

from tests.support.fixtures import agent_factory, sandbox_server, server_factory

__all__ = ["agent_factory", "sandbox_server", "server_factory"]
