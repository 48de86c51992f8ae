"""Files in the real `isolated` guest of the exec e2e (the same guest: `conftest.py`): a file
pushed through the agent link alone arrives whole (SHA-256 checked by the guest's agent, owned
by the guest's default user), is listed, and comes back byte for byte; a directory goes and
comes back as a tar stream. The MB/s of each way is printed (a TCG guest: read with the load)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from agentic_sandbox import Client
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
MiB = 1024 * 1024


def test_push_list_and_pull_in_the_isolated_guest(
    server: ServerProcess, guest: str, tmp_path: Path
) -> None:
    inst = server.ok("GET", f"/api/v2/admin/instances/{guest}")
    assert inst["network_policy"] == "isolated"
    local = tmp_path / "payload.bin"
    local.write_bytes(os.urandom(64 * MiB))
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    with Client(server.url, server.admin_token, timeout=300) as sbx:
        files = sbx.instances.files
        user = sbx.instances.exec(guest, ["id", "-un"]).stdout.data.strip()
        t0 = time.monotonic()
        up = files.upload(guest, local, "/var/tmp/e2e-files/payload.bin", parents=True)
        up_s = time.monotonic() - t0
        assert up.sha256 == digest and up.size == 64 * MiB
        check = sbx.instances.exec(guest, ["sha256sum", "/var/tmp/e2e-files/payload.bin"])
        assert check.stdout.data.split()[0] == digest

        listing = files.list(guest, "/var/tmp/e2e-files")
        assert [(e.name, e.type, e.size) for e in listing.items] == [
            ("payload.bin", "file", 64 * MiB)
        ]
        assert listing.items[0].owner == user and listing.items[0].mode == "0644"

        back = tmp_path / "back.bin"
        t0 = time.monotonic()
        got = files.download(guest, "/var/tmp/e2e-files/payload.bin", back)
        down_s = time.monotonic() - t0
        assert got.sha256 == digest and back.read_bytes() == local.read_bytes()
        print(
            f"\nguest files: upload {64 * MiB / up_s / 1e6:.1f} MB/s, "
            f"download {64 * MiB / down_s / 1e6:.1f} MB/s (64 MiB, TCG, load {os.getloadavg()})"
        )

        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "note.txt").write_text("through the tar stream\n")
        files.upload(guest, tree, "/var/tmp/e2e-files/tree")
        cat = sbx.instances.exec(guest, ["cat", "/var/tmp/e2e-files/tree/sub/note.txt"])
        assert cat.stdout.data == "through the tar stream\n"
        files.download(guest, "/var/tmp/e2e-files/tree", tmp_path / "tree-back")
        assert (tmp_path / "tree-back" / "sub" / "note.txt").read_text() == (
            "through the tar stream\n"
        )
        assert files.remove(guest, "/var/tmp/e2e-files", recursive=True).removed == 5
