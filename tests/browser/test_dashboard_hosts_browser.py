"""The dashboard's hosts panel against a real fleet (libvirt's test driver, two node files), in
headless Chromium: each host's row shows its state, committed vCPUs and memory against the
host's, and its instance count (one instance made through the API lands on a host and is
counted there); an admin's Drain marks the row draining and says what the drain did with the
host's warm pools, Undrain takes it back, and the API agrees; a viewer sees the rows and no
usable drain button. Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from agentic_sandbox.images import ImageStore
from tests.browser.browser_support import (
    PageErrors,
    assert_csp_in_force,
    launch,
    login,
    require_browser,
    screenshot,
)
from tests.support.fake_images import publish_fake
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.libvirt_testdriver import node_uri
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

IMAGE = "fake-0123456789ab"


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_browser()
    tmp = tmp_path_factory.mktemp("dashboard-hosts")
    env = {
        **TEST_SERVER_ENV,
        "SANDBOX_LIBVIRT_URI": node_uri(tmp, "local", cpus=4, memory_mib=8192),
        "SANDBOX_KVM_PROBE": "false",
    }
    server = ServerProcess(tmp / "server", env=env)
    publish_fake(ImageStore(server.data_dir / "images"), IMAGE, recipe_name="fake")
    server.start()
    try:
        server.ok(
            "POST",
            "/api/v2/admin/hosts",
            {"name": "far", "uri": node_uri(tmp, "far", cpus=8, memory_mib=16384)},
        )
        yield server
    finally:
        server.stop()


def made_instance(server: ServerProcess) -> dict[str, object]:
    op = server.ok(
        "POST", "/api/v2/admin/instances", {"id": "h-1", "image": IMAGE, "wait_ready": False}
    )
    deadline = time.monotonic() + 60
    while op["state"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, op
        time.sleep(0.1)
        op = server.ok("GET", f"/api/v2/admin/operations/{op['id']}")
    assert op["state"] == "succeeded", op
    return dict(server.ok("GET", "/api/v2/admin/instances/h-1"))


def test_hosts_panel_rows_and_drain_toggle(fleet_server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    server = fleet_server
    inst = made_instance(server)
    placed = str(inst["host"])
    hosts = {h["name"]: h for h in server.ok("GET", "/api/v2/admin/hosts")["items"]}
    assert hosts[placed]["instances"] == 1
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1400}).new_page()
            errors = PageErrors(page)
            login(page, server.url, server.admin_token)
            assert_csp_in_force(page, errors)

            # ---- one row per host, with what the API says about it ------------------------
            rows = page.locator("#hosts tbody tr")
            expect(rows).to_have_count(2)
            expect(page.locator("#hosts-count")).to_have_text("2")
            for name, h in hosts.items():
                row = page.locator(f'#hosts tr[data-host="{name}"]')
                expect(row).to_have_attribute("data-state", "reachable")
                expect(row).to_have_attribute("data-draining", "false")
                expect(row.locator(".host-state")).to_contain_text("reachable")
                expect(row.locator(".host-vcpus")).to_have_text(
                    f"{h['committed_vcpus']} / {h['cpus']}"
                )
                expect(row.locator(".host-instances")).to_have_text(str(h["instances"]))
            far = page.locator('#hosts tr[data-host="far"]')
            expect(far.locator(".host-vcpus")).to_have_text(
                f"{hosts['far']['committed_vcpus']} / 8"
            )
            expect(far.locator(".host-memory")).to_contain_text("/ 16 GiB")
            here = page.locator(f'#hosts tr[data-host="{placed}"]')
            expect(here.locator(".host-instances")).to_have_text("1")
            assert hosts[placed]["committed_vcpus"] >= 1

            # ---- drain: the row says draining, the message what happened to pools ----------
            far.locator("button.host-drain").click()
            expect(far).to_have_attribute("data-draining", "true")
            expect(far.locator(".host-state")).to_contain_text("draining")
            expect(page.locator("#hosts-message")).to_contain_text("far is draining")
            expect(page.locator("#hosts-message")).to_contain_text("no warm pools")
            assert server.ok("GET", "/api/v2/admin/hosts/far")["draining"] is True
            screenshot(page, "dashboard-hosts-drained.png")

            far.locator("button.host-undrain").click()
            expect(far).to_have_attribute("data-draining", "false")
            expect(page.locator("#hosts-message")).to_contain_text("far takes new placements")
            assert server.ok("GET", "/api/v2/admin/hosts/far")["draining"] is False
            errors.check()

            # ---- a viewer sees the hosts, and cannot drain them --------------------------
            viewer = browser.new_context(viewport={"width": 1500, "height": 1400}).new_page()
            login(viewer, server.url, server.make_token("watcher", "viewer"))
            expect(viewer.locator("#hosts tbody tr")).to_have_count(2)
            expect(viewer.locator('#hosts tr[data-host="far"] button.host-drain')).to_be_disabled()
        finally:
            browser.close()
