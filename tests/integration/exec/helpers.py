"""Helpers for the exec tier: calling the routes, reading NDJSON, checking nothing is left."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentic_sandbox.agent.cgroups import SPARES
from tests.support.polling import wait_until
from tests.support.server import ServerProcess

CGROUP_BASES = [
    Path("/sys/fs/cgroup") / c / "agentic-sandbox" for c in ("pids", "cpu", "cpuacct", "freezer")
]


def exec_path(instance_id: str, stream: bool = False) -> str:
    return f"/api/v2/admin/instances/{instance_id}/exec" + ("/stream" if stream else "")


def run(
    server: ServerProcess, instance_id: str, body: dict[str, Any], *, token: str | None = None
) -> tuple[int, Any]:
    return server.api("POST", exec_path(instance_id), body, token=token, timeout=120)


def ok(server: ServerProcess, instance_id: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = run(server, instance_id, body)
    assert status == 200, (status, out)
    assert isinstance(out, dict)
    return out


def stream_lines(
    server: ServerProcess, instance_id: str, body: dict[str, Any], *, timeout: float = 120
) -> Iterator[dict[str, Any]]:
    """The NDJSON lines of `…/exec/stream`, as they arrive."""
    req = urllib.request.Request(
        server.url + exec_path(instance_id, stream=True),
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {server.admin_token}",
        },
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        for raw in resp:
            yield json.loads(raw)


def processes_with(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True, check=False)
    mine = str(os.getpid())
    return [ln for ln in out.stdout.splitlines() if ln and not ln.startswith(mine + " ")]


def run_cgroups_of(agent_pid: int) -> list[Path]:
    """The agent's run cgroups that are not spares it keeps ready (`agent/cgroups.py`)."""
    return [p for p in agent_cgroups_of(agent_pid) if "-spare-" not in p.name]


def agent_cgroups_of(agent_pid: int) -> list[Path]:
    found: list[Path] = []
    for base in CGROUP_BASES:
        if base.is_dir():
            found += [p for p in base.iterdir() if p.name.startswith(f"{agent_pid}-")]
    return found


def _procs(cgroup: Path) -> str:
    """The cgroup's processes ("" when it was removed while we looked: it holds none)."""
    try:
        return (cgroup / "cgroup.procs").read_text().strip()
    except FileNotFoundError:
        return ""


def _cleaned(agent_pid: int) -> bool:
    """Every cgroup of the agent's runs is gone: what is left are empty spares, at most
    `SPARES` of them (a run may have used a spare: its name says nothing of the run)."""
    left = agent_cgroups_of(agent_pid)
    spares = {p.name for p in left}
    return (
        not run_cgroups_of(agent_pid) and len(spares) <= SPARES and not any(_procs(p) for p in left)
    )


def assert_cleaned_up(marker: str, agent_pid: int) -> None:
    """No process of the run is left, and its cgroups are gone."""
    wait_until(lambda: not processes_with(marker), f"processes matching {marker!r} gone")
    wait_until(lambda: _cleaned(agent_pid), "the run's cgroups removed")
