"""A full disk, for real: the server's data directory is a small tmpfs mounted in the server's
own mount namespace (`unshare -m`; the test reaches it through /proc/PID/root). Filled up, token
and secret writes answer 507 naming the storage problem (not a generic 500) and `/readyz` says
the writes fail; with the space back, both recover without a restart."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(120)

MOUNT = 'mount -t tmpfs -o size=16m,mode=0700 tmpfs "$0" && exec "$@"'


def fill(directory: Path) -> Path:
    """Write a file until the filesystem has no byte left."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        block = b"\0" * 65536
        while True:
            try:
                os.write(fd, block)
            except OSError:
                if len(block) == 1:
                    break
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    return filler


def wait_ready(server: ServerProcess, want: int, timeout: float = 30.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        status, body = server.api("GET", "/readyz")
        if status == want:
            assert isinstance(body, dict)
            return body
        assert time.monotonic() < deadline, f"/readyz stayed {status}: {body}"
        time.sleep(0.1)


def test_a_full_disk_is_named_and_readiness_reports_it(tmp_path: Path) -> None:
    disk = tmp_path / "srv" / "disk"  # the mount point: the server's whole data directory
    disk.mkdir(parents=True)
    server = ServerProcess(
        tmp_path / "srv",
        env={
            **TEST_SERVER_ENV,
            "SANDBOX_DATA_DIR": str(disk),
            "SANDBOX_ADMIN_TOKEN_FILE": str(tmp_path / "srv" / "admin-token"),
        },
        wrapper=[
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            MOUNT,
            str(disk),
        ],
    ).start()
    try:
        inside = Path(f"/proc/{server.pid}/root") / disk.relative_to("/")
        assert (inside / "sandbox.db").exists() and not (disk / "sandbox.db").exists()
        wait_ready(server, 200)
        filler = fill(inside)

        # Readiness notices by itself (its write probes), before any request fails.
        body = wait_ready(server, 503)
        storage = body["checks"]["storage"]  # type: ignore[index]
        assert storage["ok"] is False, body
        assert "database writes fail" in storage["detail"], body
        assert "data directory writes fail" in storage["detail"], body
        assert "full" in storage["detail"], body
        status, anonymous = server.api("GET", "/readyz", token="")
        assert status == 503 and anonymous["checks"]["storage"] == {"ok": False}

        status, problem = server.api(
            "POST", "/api/v2/admin/tokens", {"subject": "carol", "role": "viewer"}
        )
        assert status == 507, (status, problem)
        assert problem["code"] == "storage-full" and "storage is full" in problem["detail"]
        status, problem = server.api("PUT", "/api/v2/admin/secrets/FULL", {"value": "x" * 64})
        assert status == 507 and problem["code"] == "storage-full", (status, problem)

        filler.unlink()
        wait_ready(server, 200)
        out = server.ok("POST", "/api/v2/admin/tokens", {"subject": "carol", "role": "viewer"})
        assert out["token"].startswith("sbx_")
        assert "unhandled error" not in server.log_text()
    finally:
        server.stop()
