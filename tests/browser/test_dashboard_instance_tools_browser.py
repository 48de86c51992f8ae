"""The instance view's tools in a real headless Chromium, against a real server subprocess and a
real host agent (as root, its egress listener on loopback):

- files: list a directory of the agent's host, go into a subdirectory and back up, download a
  file (the browser's own download, with the session cookie) and compare its bytes, upload a
  file (and one named `.tar`, which must stay a file) into the directory shown and find it on
  disk with the same SHA-256, delete one; a missing directory and an upload over the server's
  size limit (413) are shown with the path and the server's reason;
- run command: `echo` shows its stdout and exit 0; a failing command shows its exit code and
  stderr; a command over its timeout shows the budget reason;
- egress: the policy and rules shown; rules replaced from the page are what the API answers
  and what the proxy applies (a request through the agent's listener to a loopback server the
  rule names is allowed, another name is denied — both listed with their verdicts, live); a bad
  rule is refused with the error next to that rule and nothing changed;
- a viewer lists and downloads, and sees no upload, delete, run or rule-saving controls.
Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.browser.browser_support import (
    PageErrors,
    assert_csp_in_force,
    launch,
    login,
    require_browser,
    screenshot,
)
from tests.support.agents import AgentProcess, register_host_instance, start_agent
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.server import ServerProcess, free_port

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

INSTANCE = "tools-1"
MAX_UPLOAD = 1024 * 1024


@dataclass
class World:
    server: ServerProcess
    agent: AgentProcess
    proxy: str  # the agent's egress listener (what an allowlist guest's tools use)
    root: Path  # a directory on the agent's host the tests browse


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello through the proxy"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


class DevServer(http.server.BaseHTTPRequestHandler):
    """What an agent's dev server answers: an HTML page."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>dev</title><h1>hello from the dev server</h1>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    require_browser()
    tmp = tmp_path_factory.mktemp("dashboard-tools")
    env = {**TEST_SERVER_ENV, "SANDBOX_FILES_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    server = ServerProcess(tmp / "server", env=env).start()
    agent = None
    try:
        port = free_port()
        agent = start_agent(
            server, INSTANCE, tmp, extra_args=["--egress-listen", f"127.0.0.1:{port}"]
        )
        root = tmp / "browse"
        (root / "sub").mkdir(parents=True)
        (root / "hello.txt").write_text("hello from the host agent\n")
        (root / "sub" / "inner.bin").write_bytes(os.urandom(70_000))
        yield World(server, agent, f"http://127.0.0.1:{port}", root)
    finally:
        if agent is not None:
            agent.stop()
        server.stop()


def open_instance(page: Any) -> None:
    page.locator(f'#instances tr[data-instance="{INSTANCE}"] button.open-instance').click()
    page.wait_for_selector("#instance-view:not([hidden])")


def go(page: Any, path: Path | str) -> None:
    page.fill("#fb-path", str(path))
    page.click("#fb-go button[type=submit]")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_files_list_navigate_download_upload_delete(world: World) -> None:
    from playwright.sync_api import expect, sync_playwright

    root = world.root
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            context = browser.new_context(viewport={"width": 1500, "height": 1600})
            page = context.new_page()
            errors = PageErrors(page)
            login(page, world.server.url, world.server.admin_token)
            assert_csp_in_force(page, errors)
            open_instance(page)
            files = page.locator("#iv-files")

            # ---- list, into a directory, download, back up -----------------------------
            go(page, root)
            expect(files).to_have_attribute("data-path", str(root))
            rows = files.locator("#fb-table tbody tr")
            expect(rows).to_have_count(2)
            expect(rows.nth(0)).to_have_attribute("data-name", "sub")  # directories first
            expect(files.locator('tr[data-name="hello.txt"]')).to_contain_text("26 B")
            files.locator('tr[data-name="sub"] .fb-open').click()
            expect(files).to_have_attribute("data-path", str(root / "sub"))
            expect(files.locator("#fb-crumbs")).to_contain_text("sub")
            with page.expect_download() as download:
                files.locator('tr[data-name="inner.bin"] .fb-download').click()
            got = Path(download.value.path()).read_bytes()
            assert download.value.suggested_filename == "inner.bin"
            assert sha256(got) == sha256((root / "sub" / "inner.bin").read_bytes())
            page.click("#fb-up")
            expect(files).to_have_attribute("data-path", str(root))

            # ---- upload into the directory shown: the bytes arrive whole ----------------
            payload = os.urandom(300_000)
            page.set_input_files(
                "#fb-file",
                files=[
                    {"name": "up.bin", "mimeType": "application/octet-stream", "buffer": payload}
                ],
            )
            page.click("#fb-upload button[type=submit]")
            state = page.locator("#fb-upload-state")
            expect(state).to_have_attribute("data-state", "done")
            expect(state).to_contain_text(f"Uploaded {root / 'up.bin'}")
            assert sha256((root / "up.bin").read_bytes()) == sha256(payload)
            expect(files.locator('tr[data-name="up.bin"]')).to_be_visible()
            # a file named .tar is a file: the page sends octet-stream, never x-tar
            page.set_input_files(
                "#fb-file",
                files=[
                    {"name": "data.tar", "mimeType": "application/x-tar", "buffer": b"not a tar"}
                ],
            )
            page.click("#fb-upload button[type=submit]")
            expect(state).to_contain_text(f"Uploaded {root / 'data.tar'}")
            assert (root / "data.tar").read_bytes() == b"not a tar"
            screenshot(page, "dashboard-files.png")

            # ---- errors, with the path and the reason -----------------------------------
            page.set_input_files(
                "#fb-file",
                files=[
                    {
                        "name": "big.bin",
                        "mimeType": "text/plain",
                        "buffer": b"x" * (MAX_UPLOAD + 4096),
                    }
                ],
            )
            page.click("#fb-upload button[type=submit]")
            expect(state).to_have_attribute("data-state", "failed")
            error = files.locator("#fb-error")
            expect(error).to_contain_text(f"Could not upload {root / 'big.bin'}")
            expect(error).to_contain_text("413")
            expect(error).to_contain_text("SANDBOX_FILES_MAX_UPLOAD_BYTES")
            assert sorted(p.name for p in root.iterdir()) == [
                "data.tar",
                "hello.txt",
                "sub",
                "up.bin",
            ]
            screenshot(page, "dashboard-files-413.png")
            go(page, root / "nowhere")
            expect(error).to_contain_text(f"Could not list {root / 'nowhere'}")
            expect(error).to_contain_text("404")
            expect(files).to_have_attribute("data-path", str(root))  # the listing stays

            # ---- delete, asked first ------------------------------------------------------
            go(page, root)
            expect(error).to_be_empty()
            files.locator('tr[data-name="data.tar"] .fb-delete').click()
            expect(page.locator("#confirm-dialog")).to_be_visible()
            page.click("#confirm-ok")
            expect(files.locator('tr[data-name="data.tar"]')).to_have_count(0)
            assert not (root / "data.tar").exists()
            expect(files.locator("#fb-message")).to_contain_text(f"Deleted {root / 'data.tar'}")
            errors.check()
        finally:
            browser.close()


def test_run_command_shows_output_exit_and_budget_reason(world: World) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1600}).new_page()
            errors = PageErrors(page)
            login(page, world.server.url, world.server.admin_token)
            open_instance(page)
            result = page.locator("#ex-result")

            # one argument per line: the spaces of the second line stay in one argument
            page.fill("#ex-argv", "echo\nhello   from exec")
            page.click("#ex-form button[type=submit]")
            expect(result).to_have_attribute("data-state", "done")
            expect(result).to_have_attribute("data-exit", "0")
            expect(page.locator("#ex-stdout")).to_have_text("hello   from exec\n")
            expect(page.locator("#ex-status")).to_contain_text("exit code 0")

            page.fill("#ex-argv", "bash\n-c\necho oops >&2; exit 3")
            page.click("#ex-form button[type=submit]")
            expect(result).to_have_attribute("data-exit", "3")
            expect(page.locator("#ex-stderr")).to_have_text("oops\n")
            expect(page.locator("#ex-status")).to_contain_text("exit code 3")
            screenshot(page, "dashboard-exec.png")

            page.fill("#ex-argv", "sleep\n60")
            page.fill("#ex-timeout", "1")
            page.click("#ex-form button[type=submit]")
            expect(result).to_have_attribute("data-reason", "timeout", timeout=20_000)
            expect(page.locator("#ex-status")).to_contain_text("ended by its budget: timeout")

            errors.check()
        finally:
            browser.close()


def proxied_get(proxy: str, url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    try:
        with opener.open(url, timeout=20) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_egress_rules_from_the_page_apply_and_events_show_verdicts(world: World) -> None:
    from playwright.sync_api import expect, sync_playwright

    server = world.server
    target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    port = target.server_address[1]
    rule = f"127.0.0.1:{port}"
    try:
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                page = browser.new_context(viewport={"width": 1500, "height": 1800}).new_page()
                errors = PageErrors(page)
                login(page, server.url, server.admin_token)
                open_instance(page)
                egress = page.locator("#iv-egress")
                before = server.ok("GET", f"/api/v2/admin/instances/{INSTANCE}/egress")
                expect(page.locator("#eg-network-now")).to_have_text(before["network"])

                # ---- replace the rules from the page ---------------------------------------
                for remove in egress.locator(".eg-remove").all():
                    remove.click()
                page.click("#eg-add")
                egress.locator(".eg-rule").last.fill(rule)
                page.click("#eg-add")
                egress.locator(".eg-rule").last.fill("*.example.org:443")
                page.select_option("#eg-network", "allowlist")
                page.click("#eg-save")
                expect(page.locator("#eg-message")).to_contain_text(
                    "Saved: 2 rules, policy allowlist"
                )
                now = server.ok("GET", f"/api/v2/admin/instances/{INSTANCE}/egress")
                assert now["network"] == "allowlist"
                assert [(r["host"], r["port"]) for r in now["allow"]] == [
                    ("127.0.0.1", port),
                    ("*.example.org", 443),
                ]
                expect(page.locator("#eg-network-now")).to_have_text("allowlist")

                # ---- they take effect: through the agent's listener, allowed and denied ----
                assert proxied_get(world.proxy, f"http://127.0.0.1:{port}/") == 200
                assert proxied_get(world.proxy, "http://not-allowed.invalid/") == 403
                events = egress.locator("#eg-events tbody")
                expect(events.locator('tr[data-verdict="allowed"]')).to_have_count(1)
                expect(events.locator('tr[data-verdict="allowed"]')).to_contain_text(rule)
                denied = events.locator('tr[data-verdict="denied"]')
                expect(denied).to_have_count(1)
                expect(denied).to_contain_text("not-allowed.invalid:80")
                expect(events.locator('tr[data-type="egress.rules.changed"]')).to_have_count(1)
                screenshot(page, "dashboard-egress.png")

                # ---- a bad rule: the error next to it, nothing changed ---------------------
                page.click("#eg-add")
                egress.locator(".eg-rule").last.fill("bad host name:80")
                page.click("#eg-save")
                bad = egress.locator('.eg-row[data-invalid="true"]')
                expect(bad).to_have_count(1)
                expect(bad.locator(".eg-rule")).to_have_value("bad host name:80")
                expect(bad.locator(".eg-rule-error")).not_to_be_empty()
                expect(egress.locator("#eg-error")).to_contain_text("422")
                again = server.ok("GET", f"/api/v2/admin/instances/{INSTANCE}/egress")
                assert again["allow"] == now["allow"]
                screenshot(page, "dashboard-egress-422.png")

                # ---- a reload shows the latest events from the API (not only live ones) ----
                page.reload()
                page.wait_for_selector("body[data-loaded=app]")
                open_instance(page)
                expect(events.locator('tr[data-verdict="denied"]')).to_have_count(1)
                expect(events.locator('tr[data-verdict="allowed"]')).to_have_count(1)
                errors.check()
            finally:
                browser.close()
    finally:
        target.shutdown()
        target.server_close()


def test_a_port_preview_link_opens_the_instances_page_through_the_proxy(world: World) -> None:
    """A web server beside the host agent (the instance's 127.0.0.1:PORT) opens in a new tab
    from the instance view's link, with the dashboard's cookie, through the reverse proxy."""
    from playwright.sync_api import expect, sync_playwright

    target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DevServer)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    port = target.server_address[1]
    try:
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                context = browser.new_context(viewport={"width": 1500, "height": 1600})
                page = context.new_page()
                errors = PageErrors(page)
                login(page, world.server.url, world.server.admin_token)
                open_instance(page)
                expect(page.locator("#pt-cli")).to_have_text(
                    f"sandboxctl instance port-forward {INSTANCE} PORT"
                )
                page.fill("#pt-port", "70000")
                page.click("#pt-form button[type=submit]")
                expect(page.locator("#pt-port-error")).to_contain_text("1 to 65535")
                expect(page.locator("#pt-link")).to_be_hidden()
                page.fill("#pt-port", str(port))
                page.click("#pt-form button[type=submit]")
                link = page.locator("#pt-link")
                expect(link).to_have_attribute(
                    "href", f"/api/v2/admin/instances/{INSTANCE}/ports/{port}/"
                )
                with context.expect_page() as opened:
                    link.click()
                tab = opened.value
                tab.wait_for_load_state()
                expect(tab.locator("h1")).to_have_text("hello from the dev server")
                assert (
                    tab.url
                    == world.server.url + f"/api/v2/admin/instances/{INSTANCE}/ports/{port}/"
                )
                screenshot(page, "dashboard-ports.png")
                errors.check()
            finally:
                browser.close()
    finally:
        target.shutdown()
        target.server_close()


def test_a_viewer_lists_and_downloads_but_has_no_changing_controls(world: World) -> None:
    from playwright.sync_api import expect, sync_playwright

    server = world.server
    owner = server.ok("GET", f"/api/v2/admin/instances/{INSTANCE}")["owner"]
    viewer = server.make_token(owner, "viewer")  # the owner, with the viewer role
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1600}).new_page()
            errors = PageErrors(page)
            login(page, server.url, viewer)
            open_instance(page)
            files = page.locator("#iv-files")
            go(page, world.root)
            expect(files.locator('tr[data-name="hello.txt"]')).to_be_visible()
            with page.expect_download() as download:
                files.locator('tr[data-name="hello.txt"] .fb-download').click()
            assert Path(download.value.path()).read_text() == "hello from the host agent\n"
            expect(page.locator("#fb-upload")).to_be_hidden()
            expect(page.locator("#fb-file")).to_be_disabled()
            expect(page.locator("#fb-readonly")).to_be_visible()
            expect(files.locator(".fb-delete")).to_have_count(0)
            expect(page.locator("#ex-form")).to_be_hidden()
            expect(page.locator("#ex-argv")).to_be_disabled()
            expect(page.locator("#ex-readonly")).to_be_visible()
            expect(page.locator("#pt-form")).to_be_hidden()
            expect(page.locator("#pt-readonly")).to_be_visible()
            expect(page.locator("#eg-save")).to_be_hidden()
            expect(page.locator("#eg-add")).to_be_hidden()
            expect(page.locator("#eg-network")).to_be_disabled()
            rules = page.locator("#iv-egress .eg-rule")
            expect(rules).to_have_count(
                len(server.ok("GET", f"/api/v2/admin/instances/{INSTANCE}/egress")["allow"])
            )
            for rule in rules.all():
                expect(rule).to_be_disabled()
            for remove in page.locator("#iv-egress .eg-remove").all():
                expect(remove).to_be_hidden()
            screenshot(page, "dashboard-tools-viewer.png")
            errors.check()
        finally:
            browser.close()


def test_an_instance_without_its_agent_says_so_in_each_tool(world: World) -> None:
    """No agent connected: the file list and a command say the server's 503 (not a blank table
    or a box stuck at "running"); the egress policy, kept by the server, still shows."""
    from playwright.sync_api import expect, sync_playwright

    server = world.server
    register_host_instance(server, "tools-absent")
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1600}).new_page()
            errors = PageErrors(page)
            login(page, server.url, server.admin_token)
            page.locator('#instances tr[data-instance="tools-absent"] button.open-instance').click()
            error = page.locator("#fb-error")
            expect(error).to_contain_text("Could not list /")
            expect(error).to_contain_text("503")
            expect(error).to_contain_text("not connected")
            expect(error.locator("button.retry")).to_be_visible()
            expect(page.locator("#fb-table tbody")).to_contain_text("Not listed")
            expect(page.locator("#eg-network-now")).not_to_be_empty()
            page.fill("#ex-argv", "true")
            page.click("#ex-form button[type=submit]")
            expect(page.locator("#ex-error")).to_contain_text("Could not run true")
            expect(page.locator("#ex-error")).to_contain_text("503")
            expect(page.locator("#ex-result")).to_be_hidden()
            expect(page.locator("#ex-argv")).to_be_enabled()  # ready for another try
            screenshot(page, "dashboard-tools-no-agent.png")
            errors.check()
        finally:
            browser.close()
