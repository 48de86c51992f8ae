"""A real server subprocess with one host-side agent (instance `a2a-1`, owned by alice)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.async_processes import AgentProc, ServerProc

INSTANCE = "a2a-1"

GREET_SKILL = {
    "id": "greet",
    "name": "Greet",
    "description": "Prints a greeting for the given name",
    "tags": ["demo"],
    "input_schema": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "minLength": 1}},
        "additionalProperties": False,
    },
    "command": [
        "python3",
        "-c",
        "import json,os; print('hello', json.loads(os.environ['A2A_DATA'])['name'])",
    ],
}


def runner(tmp: Path) -> dict[str, Any]:
    """The default runner (`bash -lc`) with HOME in the test's directory: a login shell on the
    host must not run the machine user's profile (pyenv rehash, cargo …), which is slow and,
    when a test kills it midway, can leave state behind for everyone."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return {"argv": ["bash", "-lc", "{text}"], "env": {"HOME": str(home)}}


@dataclass
class Stack:
    server: ServerProc
    agent: AgentProc
    alice: str  # alice's operator token (she owns the instance)
    key: str  # an API key for the instance with both scopes

    @property
    def url(self) -> str:
        return self.server.agent_url(INSTANCE)


@pytest.fixture
async def stack(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    env: dict[str, Any] = {
        "SANDBOX_TASK_CANCEL_GRACE_SECONDS": "1",
        "SANDBOX_PUSH_BACKOFF_INITIAL_SECONDS": "0.05",
        "SANDBOX_PUSH_BACKOFF_MAX_SECONDS": "0.2",
        # the tests' webhook receivers listen on loopback, which is refused unless allowed
        "SANDBOX_PUSH_ALLOW_NETWORKS": '["127.0.0.1/32"]',
        "SANDBOX_SESSION_HITL_QUIET_MS": "200",
    }
    env.update(getattr(request, "param", {}) or {})
    server = ServerProc(tmp_path, env={k: str(v) for k, v in env.items()})
    await server.start()
    agent = AgentProc(server, INSTANCE, tmp_path)
    try:
        alice = await server.token("alice")
        await agent.enroll_and_start(alice, skills=[GREET_SKILL], task_runner=runner(tmp_path))
        key = await server.api_key(INSTANCE, ["a2a:read", "a2a:invoke"], alice)
        yield Stack(server, agent, alice, key)
    finally:
        await agent.stop()
        await server.stop()
