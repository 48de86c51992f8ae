"""Finding the agent's cgroups from /proc (fake files over temporary directories): the v1
hybrid layout of the test hosts, a delegated v2 cgroup as in guests, and no hierarchy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentic_sandbox.agent import cgroups
from agentic_sandbox.proto import agent_pb2 as pb

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="detection refuses non-root agents")


def fake_proc(tmp: Path, cgroup: str, mounts: list[tuple[str, str, str]]) -> Path:
    proc = tmp / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    lines = [
        f"{30 + i} 23 0:{30 + i} / {point} rw,relatime - {fstype} {fstype} rw,{opts}"
        for i, (fstype, point, opts) in enumerate(mounts)
    ]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return proc


def test_v1_hybrid_uses_each_controller_under_the_agents_own_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    for c in ("memory", "pids", "cpu", "cpuacct", "freezer", "unified"):
        (root / c).mkdir(parents=True)
    (root / "memory" / "outer" / "me").mkdir(parents=True)
    proc = fake_proc(
        tmp_path,
        "8:pids:/\n4:memory:/outer/me\n2:cpuacct:/\n1:cpu:/\n6:freezer:/\n0::/\n",
        [
            ("cgroup", str(root / "cpu"), "cpu"),
            ("cgroup", str(root / "cpuacct"), "cpuacct"),
            ("cgroup", str(root / "memory"), "memory"),
            ("cgroup", str(root / "freezer"), "freezer"),
            ("cgroup", str(root / "pids"), "pids"),
            ("cgroup2", str(root / "unified"), ""),
        ],
    )
    found = cgroups.detect(proc)
    assert found.enforcement == "cgroup-v1"
    assert found.bases["memory"] == root / "memory" / "outer" / "me" / "agentic-sandbox"
    assert found.bases["pids"] == root / "pids" / "agentic-sandbox"
    assert set(found.budgets) == {"timeout", "output_bytes", "memory", "pids", "cpu"}
    assert found.support().enforcement == "cgroup-v1"


def test_v2_takes_the_delegated_cgroup_over(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    unit = root / "system.slice" / "agent.service"
    unit.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for d in (unit, unit / "agent", unit / "runs"):  # the files the kernel makes in a cgroup
        d.mkdir(exist_ok=True)
        (d / "cgroup.procs").write_text("")
        (d / "cgroup.subtree_control").write_text("")
    proc = fake_proc(
        tmp_path, "0::/system.slice/agent.service\n", [("cgroup2", str(root), "nsdelegate")]
    )
    found = cgroups.detect(proc)
    assert found.enforcement == "cgroup-v2", found.problem
    assert found.bases == {"": unit / "runs"}
    assert (unit / "agent" / "cgroup.procs").read_text() == str(os.getpid())  # moved to a leaf
    assert "+memory" in (unit / "cgroup.subtree_control").read_text()
    assert set(found.controllers) == {"memory", "pids", "cpu"}


def test_no_hierarchy_refuses_budgets_by_name(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "0::/\n", [])
    found = cgroups.detect(proc)
    assert found.enforcement == "none" and found.problem
    assert found.budgets == ["timeout", "output_bytes"]
    assert found.create("x", pb.Budget(timeout_ms=1000, output_bytes=5)) is None
    with pytest.raises(cgroups.BudgetRefused) as info:
        found.create("x", pb.Budget(memory_bytes=1 << 20))
    assert info.value.field == "budget.memory" and "memory" in info.value.message


def test_exec_runs_take_cgroups_made_ahead_and_none_outlive_the_agent(tmp_path: Path) -> None:
    """Spares: the empty dirs of a run made after a run has answered (`refill`), taken by the
    next exec instead of one mkdir per hierarchy while it waits; gone with the agent."""
    root = tmp_path / "cg"
    for c in ("memory", "pids"):
        (root / c).mkdir(parents=True)
    proc = fake_proc(
        tmp_path,
        "8:pids:/\n4:memory:/\n",
        [("cgroup", str(root / "memory"), "memory"), ("cgroup", str(root / "pids"), "pids")],
    )
    found = cgroups.detect(proc)

    def names(c: str) -> set[str]:
        return {p.name for p in (root / c / "agentic-sandbox").iterdir()}

    found.refill()
    me = os.getpid()
    spares = {f"{me}-spare-1", f"{me}-spare-2"}
    assert names("memory") == names("pids") == spares
    run = found.create("exec-7", pb.Budget(), spare=True)
    assert run is not None and {d.name for d in run.dirs.values()} <= spares
    assert len({d.name for d in run.dirs.values()}) == 1  # one run: the same leaf everywhere
    session = found.create("session-s1", pb.Budget())  # a session keeps its name (adopted by it)
    assert session is not None and session.dirs["pids"].name == f"{me}-session-s1"
    run.remove()
    session.remove()
    assert len(names("pids")) == 1  # one spare left
    found.refill()
    assert len(names("pids")) == cgroups.SPARES
    found.release()  # the agent's exit: no spare is left behind
    assert not (root / "pids" / "agentic-sandbox").exists() or not names("pids")
    # a refill that cannot make its dirs only means the next run makes its own (or says why)
    (root / "pids").rename(tmp_path / "gone")
    found.refill()
    assert found._spares == []
    with pytest.raises(cgroups.BudgetRefused):
        found.create("exec-8", pb.Budget(), spare=True)
