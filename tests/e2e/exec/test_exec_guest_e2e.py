"""Exec in a real `isolated` guest (TCG, an image built by `images`, the agent enrolled from
inside): commands run over the agent link alone, budgets are the guest kernel's cgroup v2
(the agent's delegated cgroup), each budget reason is triggered by a real runaway, and the
guest stays healthy — a later exec answers and no run cgroup is left.

One guest for the package (`conftest.py`; cold boot ~50 s), shared with the files e2e; tests
run in order.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentic_sandbox.agent.cgroups import SPARES
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


def ex(server: ServerProcess, guest: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = server.api("POST", f"/api/v2/admin/instances/{guest}/exec", body, timeout=300)
    assert status == 200, (status, out)
    assert isinstance(out, dict)
    return out


def healthy(server: ServerProcess, guest: str) -> None:
    """A later exec answers, and no run's cgroup is left in the agent's subtree."""
    out = ex(
        server,
        guest,
        {
            "argv": [
                "sh",
                "-c",
                'for d in "/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)/.."/*/; do '
                '[ -f "$d/cgroup.procs" ] && echo "$(wc -l < "$d/cgroup.procs") $d"; done',
            ]
        },
    )
    assert out["exit_code"] == 0, out
    # The listing runs in a run cgroup of its own: that one is the only one with processes.
    # The rest are the empty spares the agent keeps ready (at most SPARES): a run that was
    # left behind would be one more, or one that still holds a process.
    entries = [line.split(" ", 1) for line in out["stdout"]["data"].splitlines()]
    busy = [d for n, d in entries if n != "0"]
    assert len(busy) == 1 and len(entries) <= SPARES + 1, entries


def test_exec_runs_in_the_isolated_guest_with_cgroup_v2(server: ServerProcess, guest: str) -> None:
    inst = server.ok("GET", f"/api/v2/admin/instances/{guest}")
    assert inst["network_policy"] == "isolated"
    out = ex(server, guest, {"argv": ["sh", "-c", "id -un; uname -r; echo oops >&2; exit 4"]})
    assert out["exit_code"] == 4
    user, kernel = out["stdout"]["data"].split()
    assert user == "agent" and kernel.endswith("-cloud-amd64")
    assert out["stderr"]["data"] == "oops\n"
    assert out["enforcement"] == "cgroup-v2"
    assert out["usage"]["cpu_seconds"] > 0 and out["usage"]["peak_memory_bytes"] > 0
    out = ex(server, guest, {"argv": ["cat"], "stdin": "through the link\n"})
    assert out["stdout"]["data"] == "through the link\n"
    healthy(server, guest)


def runaway(server: ServerProcess, guest: str, argv: list[str], **budget: Any) -> dict[str, Any]:
    """Run `argv` under `budget`, then check the guest is still healthy; the answer."""
    out = ex(server, guest, {"argv": argv, "budget": budget})
    healthy(server, guest)
    return out


def test_a_memory_hog_ends_with_memory(server: ServerProcess, guest: str) -> None:
    code = "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"
    out = runaway(server, guest, ["python3", "-c", code], memory_mib=48, timeout_seconds=120)
    assert out["reason"] == "memory", out
    assert out["usage"]["peak_memory_bytes"] <= 48 << 20


def test_a_fork_bomb_ends_with_pids(server: ServerProcess, guest: str) -> None:
    # every level waits for its two children: the tree only grows, until the budget ends it
    bomb = ["bash", "-c", "b() { b & b & wait; }; b"]
    out = runaway(server, guest, bomb, pids=40, timeout_seconds=120)
    assert out["reason"] == "pids", out


def test_an_endless_loop_ends_with_timeout(server: ServerProcess, guest: str) -> None:
    out = runaway(server, guest, ["sh", "-c", "while :; do :; done"], timeout_seconds=3, cpus=0.5)
    assert out["reason"] == "timeout" and out["signal"] == "KILL", out
    assert out["usage"]["cpu_seconds"] <= 0.6 * out["duration_seconds"] + 0.2, out


def test_an_output_flood_ends_with_output_limit(server: ServerProcess, guest: str) -> None:
    out = runaway(server, guest, ["yes", "flood"], output_bytes=300_000, timeout_seconds=120)
    assert out["reason"] == "output-limit", out
    assert len(out["stdout"]["data"]) == 300_000
