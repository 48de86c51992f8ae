"""Fixtures: the in-process foundation server, and a real server with real agents."""

from tests.inproc import running
from tests.support.fixtures import agent_factory, sandbox_server

__all__ = ["agent_factory", "running", "sandbox_server"]
