"""The one `isolated` guest of the exec and files e2e modules (a cold TCG boot costs ~50 s to
minutes on a shared machine: both modules use the same guest, made once for the package)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.e2e import NAME_PREFIX, RECIPE, libvirt_server, wait_op
from tests.support.server import ServerProcess

GUEST = f"{NAME_PREFIX}exec"


@pytest.fixture(scope="package")
def server() -> Iterator[ServerProcess]:
    # a shared 2-core machine under load boots TCG guests several times slower than alone
    with libvirt_server("sbx-e2e-exec-", SANDBOX_PROVISION_READY_TIMEOUT_SECONDS="900") as srv:
        try:
            yield srv
        finally:
            srv.api("DELETE", f"/api/v2/admin/instances/{GUEST}")


@pytest.fixture(scope="package")
def guest(server: ServerProcess) -> str:
    status, op = server.api("POST", "/api/v2/admin/images", {"recipe": RECIPE})
    assert status == 202, op
    op = wait_op(server, op, timeout=900)
    assert op["state"] == "succeeded", op.get("error")
    status, op = server.api(
        "POST", "/api/v2/admin/instances", {"id": GUEST, "image": RECIPE, "loadout": "minimal"}
    )
    assert status == 202, op
    op = wait_op(server, op, timeout=1000)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    return GUEST
