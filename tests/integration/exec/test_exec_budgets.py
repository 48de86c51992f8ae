"""Budgets against real runaways on a host agent (root, this machine's cgroups): a memory hog,
a fork bomb, an endless loop (timeout, with a CPU quota) and an output flood each end with
their named reason, report their usage, and leave no process and no cgroup behind."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.exec.helpers import assert_cleaned_up, ok
from tests.support.agents import AgentProcess
from tests.support.server import ServerProcess

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="cgroup budgets need the agent to run as root"),
]


def runaway(
    server: ServerProcess, agent: AgentProcess, argv: Callable[[str], list[str]], **budget: Any
) -> dict[str, Any]:
    """Run `argv(tag)` under `budget`; check nothing of it is left; return the answer."""
    tag = f"x1mark{uuid.uuid4().hex[:10]}"
    out = ok(server, agent.instance_id, {"argv": argv(tag), "budget": budget})
    assert agent.proc is not None
    assert_cleaned_up(tag, agent.worker_pid())
    return out


def test_a_memory_hog_ends_with_memory(sandbox_server: ServerProcess, agent: AgentProcess) -> None:
    out = runaway(
        sandbox_server,
        agent,
        lambda tag: [
            "python3",
            "-c",
            f"# {tag}\nx = []\nwhile True:\n    x.append(bytearray(1 << 20))",
        ],
        memory_mib=64,
        timeout_seconds=60,
    )
    assert out["reason"] == "memory" and out["signal"] == "KILL", out
    assert out["enforcement"] == "cgroup-v1"
    peak = out["usage"]["peak_memory_bytes"]
    assert 32 << 20 < peak <= 64 << 20, peak  # it got near its limit, never past it


def test_a_fork_bomb_ends_with_pids(sandbox_server: ServerProcess, agent: AgentProcess) -> None:
    # every level waits for its two children: the tree only grows, until the budget ends it
    out = runaway(
        sandbox_server,
        agent,
        lambda tag: ["bash", "-c", f"b() {{ b & b & wait; }}; b # {tag}"],
        pids=32,
        timeout_seconds=60,
    )
    assert out["reason"] == "pids", out


def test_an_endless_loop_ends_with_timeout_within_its_cpu_quota(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = runaway(
        sandbox_server,
        agent,
        lambda tag: ["python3", "-c", f"# {tag}\nwhile True: pass"],
        timeout_seconds=2,
        cpus=0.2,
    )
    assert out["reason"] == "timeout" and out["signal"] == "KILL", out
    assert out["duration_seconds"] >= 2
    # a fifth of one CPU over the run (the kernel's quota; it can only be less on a busy box)
    assert 0 < out["usage"]["cpu_seconds"] <= 0.3 * out["duration_seconds"] + 0.1, out
    assert out["budget"]["cpus"] == 0.2


def test_an_output_flood_ends_with_output_limit(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = runaway(
        sandbox_server,
        agent,
        lambda tag: ["sh", "-c", f"yes {tag}"],
        output_bytes=200_000,
        timeout_seconds=60,
    )
    assert out["reason"] == "output-limit", out
    kept = out["stdout"]["data"]
    assert len(kept) == 200_000 and kept.startswith("x1mark")  # exactly the budget arrived
    assert out["stdout"]["bytes"] >= 200_000 and out["stdout"]["truncated"]


def test_the_agent_runs_again_after_every_runaway(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = ok(sandbox_server, agent.instance_id, {"argv": ["echo", "still here"]})
    assert out["stdout"]["data"] == "still here\n" and out["reason"] is None
