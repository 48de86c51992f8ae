"""The dashboard's create dialog and instance actions against a real fleet, in headless Chromium.

The server subprocess runs its fleet on libvirt's test driver (a private node file: no VM, no
network) with a fake image published in its image cache, as tests/integration/instances does:
- a create with an unknown image shows the server's field error next to the Image field;
- a create with the fake image answers 202 + an operation; its stages and progress are shown
  until it succeeds, and the new instance appears in the list with its host;
- instance actions: suspend/resume, a snapshot (listed in the instance view), delete after a
  confirmation.
Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import re
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
    tmp = tmp_path_factory.mktemp("dashboard-fleet")
    env = {
        **TEST_SERVER_ENV,
        "SANDBOX_LIBVIRT_URI": node_uri(tmp, "local"),
        "SANDBOX_KVM_PROBE": "false",
    }
    server = ServerProcess(tmp / "server", env=env)
    publish_fake(ImageStore(server.data_dir / "images"), IMAGE, recipe_name="fake")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_create_dialog_operation_progress_and_actions(fleet_server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    server = fleet_server
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1100}).new_page()
            errors = PageErrors(page)
            login(page, server.url, server.admin_token)
            assert_csp_in_force(page, errors)

            # ---- the dialog offers the cache's images, the loadouts and the hosts ----------
            page.click("#create-open")
            expect(page.locator("#create-dialog")).to_be_visible()
            expect(page.locator(f'#create-images option[value="{IMAGE}"]')).to_have_count(1)
            expect(page.locator('#create-loadout option[value="dev"]')).to_have_count(1)
            expect(page.locator('#create-host option[value="local"]')).to_have_count(1)
            expect(page.locator("#create-fleet-notice")).to_be_hidden()

            # ---- an unknown image: the error is shown next to the Image field --------------
            page.fill("#create-id", "vm-1")
            page.fill("#create-image", "no-such-image")
            page.click("#create-submit")
            expect(page.locator("#create-image-error")).to_have_text("unknown image")
            expect(page.locator("#create-image")).to_have_attribute("aria-invalid", "true")
            expect(page.locator("#create-error")).to_contain_text("highlighted field")
            expect(page.locator("#create-id-error")).to_be_empty()
            screenshot(page, "dashboard-create-unknown-image.png")

            # ---- an unknown snapshot source: a 404 problem in the banner -------------------
            page.check('input[name=source][value="snapshot"]')
            expect(page.locator("#create-image")).to_be_hidden()
            page.fill("#create-snapshot", "nowhere/snap")
            page.click("#create-submit")
            expect(page.locator("#create-error")).to_contain_text("404")
            expect(page.locator("#create-error")).to_contain_text("nowhere")
            page.check('input[name=source][value="image"]')

            # ---- a good create: 202 + an operation whose stages are shown live -------------
            page.fill("#create-image", IMAGE)
            expect(page.locator("#create-image")).not_to_have_attribute("aria-invalid", "true")
            page.fill("#create-cpus", "2")
            page.select_option("#create-host", "local")
            page.click("#create-dialog details summary")
            page.uncheck("#create-wait")  # no agent will enroll on the test driver
            page.click("#create-submit")
            progress = page.locator("#op-progress")
            expect(progress).to_be_visible()
            expect(page.locator("#op-subject")).to_have_text("vm-1")
            expect(page.locator("#op-state")).to_have_text("succeeded", timeout=30_000)
            stages = page.locator("#op-stages li")
            names = stages.evaluate_all("els => els.map(e => e.dataset.stage)")
            assert names[0] == "seed" and names[-1] == "ready", names
            assert {"placing", "disk", "defining", "booting"} <= set(names), names
            # the host lacked the image: its upload is a stage, with its bytes and host
            expect(page.locator('#op-stages li[data-stage="uploading"] .stage-bytes')).to_have_text(
                re.compile(r"^ (\d+\.\d) / \1 MiB to host local$")
            )
            expect(page.locator('#op-stages li[data-done="false"]')).to_have_count(0)
            assert page.evaluate("document.querySelector('#op-bar').value") == 1
            expect(page.locator("#op-percent")).to_have_text("100%")
            screenshot(page, "dashboard-create-progress.png")
            page.click("#op-close")
            expect(page.locator("#create-dialog")).to_be_hidden()

            # ---- the new instance in the list, with its host -------------------------------
            row = page.locator('#instances tr[data-instance="vm-1"]')
            expect(row.locator(".inst-state")).to_have_text("running")
            expect(row.locator(".inst-host")).to_have_text("local")
            expect(row).to_contain_text("2 vCPU")
            page.click("#operations-box summary")
            expect(page.locator("#operations li").first).to_contain_text("provision vm-1")
            expect(page.locator('#events li[data-type="operation.succeeded"]')).to_have_count(1)

            # ---- lifecycle actions -------------------------------------------------------
            row.locator("button.open-instance").click()
            expect(page.locator("#iv-id")).to_have_text("vm-1")
            expect(page.locator('#iv-facts dd[data-fact="host"]')).to_have_text("local")
            expect(page.locator('#iv-actions [data-action="start"]')).to_be_disabled()
            page.click('#iv-actions [data-action="suspend"]')
            expect(row.locator(".inst-state")).to_have_text("paused")
            expect(page.locator("#iv-message")).to_contain_text("now paused")
            expect(page.locator('#iv-actions [data-action="resume"]')).to_be_enabled()
            page.click('#iv-actions [data-action="resume"]')
            expect(row.locator(".inst-state")).to_have_text("running")

            # a snapshot, listed in the instance view
            page.click('#iv-actions [data-action="snapshot"]')
            expect(page.locator("#snapshot-dialog")).to_be_visible()
            page.fill("#snapshot-name", "Bad Name")
            page.click("#snapshot-form button[type=submit]")
            expect(page.locator("#snapshot-error")).to_contain_text("name")
            page.fill("#snapshot-name", "s1")
            page.click("#snapshot-form button[type=submit]")
            expect(page.locator("#snapshot-dialog")).to_be_hidden()
            expect(page.locator('#iv-snapshots li[data-snapshot="s1"]')).to_contain_text("memory")
            page.evaluate("() => window.scrollTo(0, 0)")
            screenshot(page, "dashboard-instance-view.png")

            # delete: asks first; cancel keeps it, confirm removes it
            page.click('#iv-actions [data-action="delete"]')
            expect(page.locator("#confirm-dialog")).to_be_visible()
            page.keyboard.press("Escape")
            expect(page.locator("#confirm-dialog")).to_be_hidden()
            expect(row).to_be_visible()
            page.click('#iv-actions [data-action="delete"]')
            page.click("#confirm-ok")
            expect(row).to_have_count(0, timeout=20_000)
            expect(page.locator("#instances-message")).to_have_text("Instance vm-1 deleted.")
            expect(page.locator("#instance-view")).to_be_hidden()
            errors.check()
        finally:
            browser.close()
