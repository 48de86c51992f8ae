"""The dashboard's loadouts view against a real server (fleet on libvirt's test driver), in
headless Chromium: the loadouts at their active version, a loadout's versions, a diff between
two versions, activation with the version the page saw active, and a 409 — someone moved the
active version behind the page's back — said plainly, with the versions reloaded.
Screenshots go to tests/artifacts/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentic_sandbox import Client
from tests.browser.browser_support import (
    PageErrors,
    assert_csp_in_force,
    launch,
    login,
    require_browser,
    screenshot,
)
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.libvirt_testdriver import node_uri
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_browser()
    tmp = tmp_path_factory.mktemp("dashboard-loadouts")
    env = {
        **TEST_SERVER_ENV,
        "SANDBOX_LIBVIRT_URI": node_uri(tmp, "local"),
        "SANDBOX_KVM_PROBE": "false",
    }
    server = ServerProcess(tmp / "server", env=env)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_loadouts_versions_diff_and_activation(fleet_server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    server = fleet_server
    with Client(server.url, server.admin_token) as sbx:
        base = {"name": "web", "extends": "minimal"}
        sbx.loadouts.apply({**base, "description": "web v1", "resources": {"cpus": 1}})
        sbx.loadouts.apply({**base, "description": "web v2", "resources": {"cpus": 2}})
        sbx.loadouts.apply({**base, "description": "web v3", "resources": {"cpus": 3}})
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                page = browser.new_context(viewport={"width": 1500, "height": 1400}).new_page()
                errors = PageErrors(page)
                login(page, server.url, server.admin_token)
                assert_csp_in_force(page, errors)

                # ---- the list: each loadout at its active version -------------------------
                web = page.locator('#loadouts tr[data-loadout="web"]')
                expect(web.locator(".lo-active")).to_have_text("v1")
                expect(page.locator('#loadouts tr[data-loadout="minimal"]')).to_contain_text(
                    "system (shared)"
                )

                # ---- versions of one -------------------------------------------------------
                web.locator(".lo-versions").click()
                box = page.locator("#loadout-versions")
                expect(box).to_be_visible()
                rows = box.locator("#lv-table tbody tr")
                expect(rows).to_have_count(3)
                expect(rows.nth(0)).to_have_attribute("data-active", "true")
                expect(rows.nth(0)).to_contain_text("minimal@1")
                expect(rows.nth(0).locator(".lv-activate")).to_be_disabled()

                # ---- a diff between two versions ------------------------------------------
                page.select_option("#lv-diff-a", "1")
                page.select_option("#lv-diff-b", "2")
                page.click("#lv-diff-form button[type=submit]")
                diff = page.locator("#lv-diff")
                expect(diff).to_be_visible()
                expect(diff.locator('[data-op="del"]').first).to_contain_text("web v1")
                expect(diff.locator('[data-op="add"]').first).to_contain_text("web v2")
                assert diff.locator('[data-op="del"]').count() == 2  # description, cpus
                assert diff.locator('[data-op="add"]').count() == 2
                page.check("#lv-diff-resolved")  # with extends applied: minimal's runner too
                page.click("#lv-diff-form button[type=submit]")
                expect(diff).to_contain_text('"task_runner"')
                screenshot(page, "dashboard-loadout-diff.png")

                # ---- activate, with the version the page saw active -----------------------
                box.locator('tr[data-version="2"] .lv-activate').click()
                expect(page.locator("#lv-message")).to_contain_text("Version 2 of web is active")
                expect(box).to_have_attribute("data-active", "2")
                expect(web.locator(".lo-active")).to_have_text("v2")
                assert sbx.loadouts.get("web").version == 2

                # ---- someone else moves it; the page's activation is refused, plainly -----
                sbx.loadouts.activate("web", 3, expected_version=2)
                box.locator('tr[data-version="1"] .lv-activate').click()
                error = page.locator("#lv-error")
                expect(error).to_contain_text("Version 1 was not activated")
                expect(error).to_contain_text("it is v3 now, not v2")
                expect(error).to_have_attribute("data-code", "conflict")
                expect(box).to_have_attribute("data-active", "3")  # the versions reloaded
                expect(box.locator('tr[data-version="3"]')).to_have_attribute("data-active", "true")
                expect(web.locator(".lo-active")).to_have_text("v3")
                assert sbx.loadouts.get("web").version == 3  # nothing changed by the refusal
                expect(error).to_contain_text("it is v3 now")  # still said after the reload
                screenshot(page, "dashboard-loadout-409.png")

                # ---- then activating from the fresh list works ----------------------------
                box.locator('tr[data-version="1"] .lv-activate').click()
                expect(page.locator("#lv-message")).to_contain_text("Version 1 of web is active")
                expect(page.locator("#lv-error")).to_be_empty()
                errors.check()
            finally:
                browser.close()
