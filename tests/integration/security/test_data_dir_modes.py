"""No other local user reads anything of the data directory: not a seed (it holds a one-time
enrollment token), not the database (audit, events, artifacts, session commands), not a
recording. QEMU — libvirt's qemu user — still reaches the fleet's files.

The data directory lives under a world-traversable folder (not the test's private tmp), and
the checks run as real other users (`runuser`), as the attacker in the review did."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentic_sandbox.images import ImageStore
from tests.support.agents import start_agent
from tests.support.fake_images import publish_fake
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.libvirt_testdriver import node_uri
from tests.support.server import ServerProcess
from tests.support.sessions import create_session, wait_state

IMAGE = "fake-0123456789ab"


def as_user(user: str, *argv: str) -> int:
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True).returncode


@pytest.fixture
def world_dir() -> Iterator[Path]:
    assert os.geteuid() == 0, "this test acts as other local users: run it as root"
    base = Path(tempfile.mkdtemp(prefix="sbx-modes-", dir="/var/tmp"))
    base.chmod(0o755)  # anyone may traverse to the data dir: only its own modes protect it
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_no_local_user_reads_the_data_dir_and_qemu_reaches_the_fleet(
    world_dir: Path, tmp_path: Path
) -> None:
    data = world_dir / "data"
    publish_fake(ImageStore(data / "images"), IMAGE, recipe_name="fake")
    server = ServerProcess(
        data,
        env={
            **TEST_SERVER_ENV,
            "SANDBOX_LIBVIRT_URI": node_uri(tmp_path, "local"),
            "SANDBOX_KVM_PROBE": "false",
        },
    ).start()
    try:
        # a provision waiting for its agent (its seed, with the token, is on disk) ...
        op = server.ok("POST", "/api/v2/admin/instances", {"id": "modes-1", "image": IMAGE})
        deadline = time.monotonic() + 30
        while server.ok("GET", f"/api/v2/admin/operations/{op['id']}")["stage"] != "enrolling":
            assert time.monotonic() < deadline, "the provision never reached enrolling"
            time.sleep(0.1)
        # ... and a session with a recording
        agent = start_agent(server, "modes-agent", tmp_path)
        sid = create_session(server, "modes-agent", ["echo", "recorded"])
        wait_state(server, sid, ("exited",))
        agent.stop()

        files = [p for p in data.rglob("*") if p.is_file()]
        names = {p.name for p in files}
        assert {"sandbox.db", "admin-token", "secrets.key"} <= names, sorted(names)
        seeds = [p for p in files if p.name.endswith(".iso") and "modes-1" in p.name]
        assert seeds, "the provision's seed is on disk"
        assert [p for p in files if p.suffix == ".cast"], "a recording is on disk"

        # another local user gets nowhere: not into the data dir, not to any file in it
        assert as_user("nobody", "ls", str(data)) != 0
        readable = [str(p) for p in files if as_user("nobody", "test", "-r", str(p)) == 0]
        assert readable == []
        # the files that matter are private by their own modes too
        for p in [*seeds, data / "sandbox.db", data / "admin-token", data / "secrets.key"]:
            assert p.stat().st_mode & 0o077 == 0, f"{p} is {oct(p.stat().st_mode & 0o777)}"
        for extra in ("sandbox.db-wal", "sandbox.db-shm"):
            if (data / extra).exists():
                assert (data / extra).stat().st_mode & 0o077 == 0, extra
        # QEMU traverses to the fleet's folders (by group), and only QEMU
        qemu_group = grp.getgrnam("libvirt-qemu")
        assert data.stat().st_gid == qemu_group.gr_gid and data.stat().st_mode & 0o777 == 0o710
        for folder in (data / "fleet", data / "fleet" / "instances", data / "fleet" / "bases"):
            assert as_user("libvirt-qemu", "test", "-x", str(folder)) == 0, folder
            assert folder.stat().st_mode & 0o007 == 0, folder
    finally:
        server.stop()
