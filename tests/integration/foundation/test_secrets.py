"""Secrets are write-only, encrypted at rest, and never appear in responses, events or logs."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from agentic_sandbox.broker.observability.logs import JsonFormatter
from tests.support.inproc_server import Running

VALUE = "tok-3f9a-very-secret-value-0042"


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def captured_logs() -> Capture:
    handler = Capture()
    root = logging.getLogger()
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


async def test_secret_value_never_comes_back(running: Running, captured_logs: Capture) -> None:
    status, body, _ = await running.call(
        "PUT", "/api/v2/admin/secrets/GITHUB_TOKEN", json={"value": VALUE}
    )
    assert status == 201
    assert VALUE not in str(body) and body["version"] == 1
    status, body, _ = await running.call(
        "PUT", "/api/v2/admin/secrets/GITHUB_TOKEN", json={"value": VALUE + "-2"}
    )
    assert status == 200 and body["version"] == 2
    status, listing, _ = await running.call("GET", "/api/v2/admin/secrets")
    assert VALUE not in str(listing)
    # A request that carries the value in its path (and so in the access log line) is masked.
    await running.call("GET", f"/api/v2/admin/secrets/{VALUE}")
    logging.getLogger("test").warning("user pasted %s into a form", VALUE)
    status, events, _ = await running.call("GET", "/api/v1/events?limit=200")
    status, audit, _ = await running.call("GET", "/api/v2/admin/audit")
    joined = "\n".join(captured_logs.lines)
    assert "***" in joined
    for where in (joined, str(events), str(audit)):
        assert VALUE not in where


async def test_encrypted_at_rest_with_private_key(running: Running) -> None:
    await running.call("PUT", "/api/v2/admin/secrets/DB_PASSWORD", json={"value": VALUE})
    data = running.svc.settings.data_dir
    key = data / "secrets.key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    for f in data.glob("sandbox.db*"):
        assert VALUE.encode() not in f.read_bytes()
    # and the server can still open it for the instance it is bound to
    from sqlalchemy import select

    from agentic_sandbox.broker.store import models as m

    async with running.svc.db.session() as s:
        row = await s.scalar(select(m.Secret).where(m.Secret.name == "DB_PASSWORD"))
    assert row is not None
    assert running.svc.vault.open(row.ciphertext).decode() == VALUE


async def test_bad_secret_names_and_unknown_instances(running: Running) -> None:
    status, body, _ = await running.call(
        "PUT", "/api/v2/admin/secrets/9bad", json={"value": "x" * 8}
    )
    assert status == 422 and body["errors"][0]["field"] == "path.name"
    status, body, _ = await running.call(
        "PUT", "/api/v2/admin/secrets/OK_NAME", json={"value": "x" * 8, "instances": ["nope-1"]}
    )
    assert status == 404 and "nope-1" in body["detail"]
    status, body, _ = await running.call("PUT", "/api/v2/admin/secrets/OK_NAME", json={"value": ""})
    assert status == 422 and body["errors"][0]["field"] == "body.value"
