"""Agent bundles and rollouts from a test: a re-versioned bundle, its upload, a rollout
waited for (`broker/upgrades`)."""

from __future__ import annotations

import io
import json
import tarfile
import time
import urllib.error
import urllib.request
from typing import Any

from agentic_sandbox.provision.bundle import MANIFEST, build_bundle, pack_bundle
from tests.support.server import ServerProcess


def repack(version: str, replace: dict[str, bytes] | None = None) -> bytes:
    """The server's own bundle with its manifest naming `version` (and files replaced)."""
    members: list[tuple[str, bytes]] = []
    with tarfile.open(fileobj=io.BytesIO(build_bundle())) as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member)
            assert f is not None
            members.append((member.name, f.read()))
    changes = {MANIFEST: json.dumps({"version": version}).encode(), **(replace or {})}
    return pack_bundle([(name, changes.get(name, data)) for name, data in members])


def upload(server: ServerProcess, data: bytes, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        server.url + "/api/v2/admin/agent-bundles", data=data, method="POST"
    )
    req.add_header("Content-Type", "application/gzip")
    req.add_header("Authorization", f"Bearer {token or server.admin_token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def roll_out(server: ServerProcess, body: dict[str, Any], timeout: float = 200) -> dict[str, Any]:
    op = server.ok("POST", "/api/v2/admin/agent-rollouts", body)
    assert op["kind"] == "agent-rollout"
    deadline = time.monotonic() + timeout
    while op["state"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, f"the rollout is still {op['state']}: {op}"
        time.sleep(0.2)
        op = server.ok("GET", f"/api/v2/admin/operations/{op['id']}")
    return dict(op)
