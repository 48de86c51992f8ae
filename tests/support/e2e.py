"""Helpers of the e2e tier (real libvirtd + QEMU guests): libvirt checks, operations, listings.

Instance ids of the tier's newer modules start with `NAME_PREFIX` (`$SANDBOX_TEST_NAME_PREFIX`,
default `e2e-`), so that several people's runs on one libvirtd never make the same domain.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerProcess

CACHE = Path(os.environ.get("SANDBOX_TEST_CACHE", "/var/tmp/agentic-sandbox-test-cache"))
RECIPE = "debian-12-agent"
NAME_PREFIX = os.environ.get("SANDBOX_TEST_NAME_PREFIX", "e2e-")
URI = "qemu:///system"

# A server on the real libvirtd, with the tier's cached image builds.
REAL_SERVER_ENV = {
    "SANDBOX_LIBVIRT_URI": URI,
    "SANDBOX_IMAGES_DIR": str(CACHE),
    "SANDBOX_KVM_PROBE": "false",
    "SANDBOX_PROVISION_READY_TIMEOUT_SECONDS": "300",
    "SANDBOX_AGENT_HEARTBEAT_SECONDS": "2",
}


def require_real_libvirt() -> None:
    if os.geteuid() != 0:
        pytest.fail("the e2e tier runs as root (libvirt qemu:///system, image builds)")
    res = subprocess.run(
        ["virsh", "-c", URI, "version"], capture_output=True, text=True, timeout=30
    )
    if res.returncode != 0:
        pytest.fail(
            f"libvirtd is not answering on {URI}: {res.stderr.strip()} "
            "(scripts/services.sh starts it)"
        )


def domains_named(fragment: str) -> list[str]:
    res = subprocess.run(
        ["virsh", "-c", URI, "list", "--all", "--name"], capture_output=True, text=True, timeout=30
    )
    return [n for n in res.stdout.split() if fragment in n]


def domains_under(data_dir: Path) -> list[str]:
    """The libvirt domains whose disks lie under `data_dir` (one server's or fleet's own; other
    runs on the same libvirtd have theirs)."""
    res = subprocess.run(
        ["virsh", "-c", URI, "list", "--all", "--name"], capture_output=True, text=True, timeout=30
    )
    found = []
    for name in res.stdout.split():
        xml = subprocess.run(
            ["virsh", "-c", URI, "dumpxml", name], capture_output=True, text=True, timeout=30
        ).stdout
        if f"{data_dir}/" in xml:
            found.append(name)
    return found


def pools_of(data_dir: Path) -> list[str]:
    """The libvirt storage pools whose directory lies under `data_dir`."""
    res = subprocess.run(
        ["virsh", "-c", URI, "pool-list", "--all", "--name"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    found = []
    for name in res.stdout.split():
        xml = subprocess.run(
            ["virsh", "-c", URI, "pool-dumpxml", name], capture_output=True, text=True, timeout=30
        ).stdout
        if f"<path>{data_dir}/" in xml:
            found.append(name)
    return found


def wait_op(srv: ServerProcess, op: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Poll an operation until it ends (the deadline only bounds a hung run)."""
    deadline = time.monotonic() + timeout
    while op["state"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, f"operation still {op['state']}: {op}"
        time.sleep(1)
        op = srv.ok("GET", f"/api/v2/admin/operations/{op['id']}")
    return op


def wait_agent(srv: ServerProcess, instance: str, timeout: float = 120) -> float:
    """Seconds until the instance's agent is connected (after a restore it reconnects)."""
    started = time.monotonic()
    while True:
        status, agent = srv.api("GET", f"/api/v2/admin/agents/{instance}")
        if status == 200 and agent.get("state") == "connected":
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"agent of {instance}: {agent}"
        time.sleep(0.5)


def provision(srv: ServerProcess, body: dict[str, Any], timeout: float = 420) -> dict[str, Any]:
    status, op = srv.api("POST", "/api/v2/admin/instances", body)
    assert status == 202, op
    return wait_op(srv, op, timeout)


def listing(root: Path) -> set[str]:
    """Every file and directory under `root` (relative paths), the whole tree."""
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*")}


def forget_pools(data_dir: Path) -> None:
    """Stop and undefine the libvirt storage pools a fleet made for `data_dir` (persistent
    definitions outlive the directory otherwise)."""
    for name in pools_of(data_dir):
        for verb in ("pool-destroy", "pool-undefine"):
            subprocess.run(["virsh", "-c", URI, verb, name], capture_output=True, timeout=30)


@contextlib.contextmanager
def libvirt_server(prefix: str, **env: str) -> Iterator[ServerProcess]:
    """A started server on the real libvirtd, its data directory under /var/tmp (QEMU, as
    libvirt-qemu, must traverse its parents: not /tmp's 0700 pytest folders). Afterwards the
    server is stopped, its storage pools forgotten and its directory removed; a domain of its
    left behind fails the test."""
    require_real_libvirt()
    data = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    data.chmod(0o755)
    srv = ServerProcess(data / "data", env={**REAL_SERVER_ENV, **env})
    (data / "data").chmod(0o755)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        leftovers = domains_under(data)
        forget_pools(data / "data")
        shutil.rmtree(data, ignore_errors=True)
        assert leftovers == [], f"domains left behind: {leftovers}"
