"""A `sandbox-server` on the real libvirt (qemu:///system, TCG), for e2e tests.

    with libvirt_server("sbx-x1-e2e-") as srv:
        op = wait_op(srv, srv.ok("POST", "/api/v2/admin/instances", body), timeout=420)

Fails (never skips) when not root or when libvirtd does not answer. The data directory lives
under /var/tmp (QEMU, as libvirt-qemu, must traverse it) and is removed afterwards.
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


def require_real_libvirt() -> None:
    if os.geteuid() != 0:
        pytest.fail("the e2e tier runs as root (libvirt qemu:///system, image builds)")
    res = subprocess.run(
        ["virsh", "-c", "qemu:///system", "version"], capture_output=True, text=True, timeout=30
    )
    if res.returncode != 0:
        pytest.fail(
            f"libvirtd is not answering on qemu:///system: {res.stderr.strip()} "
            "(scripts/services.sh starts it)"
        )


@contextlib.contextmanager
def libvirt_server(prefix: str, **env: str) -> Iterator[ServerProcess]:
    require_real_libvirt()
    # QEMU runs as libvirt-qemu: the data directory's parents must be traversable (not /tmp's
    # 0700 pytest folders).
    data = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    data.chmod(0o755)
    srv = ServerProcess(
        data / "data",
        env={
            "SANDBOX_LIBVIRT_URI": "qemu:///system",
            "SANDBOX_IMAGES_DIR": str(CACHE),
            "SANDBOX_KVM_PROBE": "false",
            "SANDBOX_PROVISION_READY_TIMEOUT_SECONDS": "300",
            "SANDBOX_AGENT_HEARTBEAT_SECONDS": "2",
            **env,
        },
    )
    (data / "data").chmod(0o755)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)


def wait_op(srv: ServerProcess, op: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Follow an operation until it ends (or fail after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while op["state"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, f"operation still {op['state']}: {op}"
        time.sleep(1)
        op = srv.ok("GET", f"/api/v2/admin/operations/{op['id']}")
    return op
