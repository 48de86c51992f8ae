"""Fixtures: a real server and real host-side agents."""

from tests.support.fixtures import agent_factory, sandbox_server, server_factory

__all__ = ["agent_factory", "sandbox_server", "server_factory"]
