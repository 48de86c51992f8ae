"""SQLite's single node: the data-dir lock refuses a second holder naming the first; the fence
and the leader redirect stay out of its way; writes outside `Database` go through `begin()`."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from agentic_sandbox.broker.cluster import DataDirBusy, DataDirLock, NodeInfo, Role, SingleNode

ROOT = Path(__file__).resolve().parents[3]


def me(name: str) -> NodeInfo:
    return NodeInfo(name, f"http://127.0.0.1:9/{name}", "127.0.0.1:8", "test")


def test_second_lock_on_a_data_dir_names_the_first(tmp_path: Path) -> None:
    first = DataDirLock(tmp_path)
    first.acquire(me("alpha"))
    try:
        with pytest.raises(DataDirBusy) as info:
            DataDirLock(tmp_path).acquire(me("beta"))
        text = str(info.value)
        assert f"node alpha, pid {os.getpid()}, http://127.0.0.1:9/alpha" in text
        assert str(tmp_path / "server.lock") in text
        assert oct((tmp_path / "server.lock").stat().st_mode & 0o777) == "0o600"
    finally:
        first.release()
    again = DataDirLock(tmp_path)  # released: the next one gets it
    again.acquire(me("beta"))
    again.release()


async def test_single_node_leads_without_a_term(tmp_path: Path) -> None:
    node = SingleNode(me("alpha"), tmp_path)
    await node.start()
    try:
        await node.elected()
        assert node.role is Role.single and node.term is None
        assert node.leader is not None and node.leader.node == "alpha"
    finally:
        await node.stop()


def test_no_engine_begin_outside_the_store() -> None:
    """Every write transaction goes through `Database.session()`/`begin()`, where the fence is."""
    found = []
    for path in (ROOT / "agentic_sandbox").rglob("*.py"):
        if path.parts[-3:] == ("broker", "store", "db.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"engine\.begin\(", line):
                found.append(f"{path.relative_to(ROOT)}:{n}")
    assert not found, found
