"""Exec-tier fixtures: a real server subprocess and real agent-client processes (as root, on
this machine's cgroups)."""

from tests.support.fixtures import agent_factory, sandbox_server, server_factory

__all__ = ["agent_factory", "sandbox_server", "server_factory"]
