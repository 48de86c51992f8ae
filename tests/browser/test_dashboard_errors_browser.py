"""The dashboard's error paths in a real headless Chromium: every failure is a clear message the
user can recover from — never a blank page, a stuck spinner or a silent no-op.

A real server subprocess with its fleet on libvirt's test driver (a private node file: no VM, no
network), a fake image in its cache, and at most one instance per owner (so the server's real
quota answers a second create with 429). Each test signs in as its own operator, so their
quotas do not meet.
- a session revoked through the API while the page is open (the event stream ends, or the next
  call answers 401), or whose cookie runs out, returns to sign-in saying so; signing in again
  works;
- a create the request alone refutes (the `dev` loadout installs packages at first boot, the
  instance asks for `isolated`) is a 422 shown next to the Network field; a create that really
  fails later (more vCPUs than any host has: refused at placement) shows the stage it failed at
  and the server's cause in the progress view, and "Change and retry" goes back to the filled
  form;
- a create over the quota shows the server's 429 (its detail, Retry-After) with a Retry that
  succeeds once an instance is deleted;
- a 5xx and a network failure on create (Playwright route interception: the only faked
  answers here), a page whose lists fail to load and a dashboard that cannot say who is signed
  in each show what happened with a Retry that recovers once the fault is gone.
The dashboard routes every call through one function (static/api.js) and shows every failure
the same way (static/alerts.js); these tests check what the user sees.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentic_sandbox.images import ImageStore
from tests.browser.browser_support import (
    PageErrors,
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
INSTANCES = re.compile(r"/api/v2/admin/instances(\?|$)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_browser()
    tmp = tmp_path_factory.mktemp("dashboard-errors")
    env = {
        **TEST_SERVER_ENV,
        "SANDBOX_LIBVIRT_URI": node_uri(tmp, "local"),
        "SANDBOX_KVM_PROBE": "false",
        "SANDBOX_MAX_INSTANCES_PER_OWNER": "1",
    }
    srv = ServerProcess(tmp / "server", env=env)
    publish_fake(ImageStore(srv.data_dir / "images"), IMAGE, recipe_name="fake")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def operator(server: ServerProcess, subject: str) -> tuple[str, str]:
    """A fresh operator token: (token id, secret)."""
    out = server.ok("POST", "/api/v2/admin/tokens", {"subject": subject, "role": "operator"})
    return str(out["id"]), str(out["token"])


def wait_op(server: ServerProcess, op: dict[str, Any], token: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while op["state"] not in ("succeeded", "failed", "canceled"):
        assert time.monotonic() < deadline, op
        time.sleep(0.1)
        op = server.ok("GET", f"/api/v2/admin/operations/{op['id']}", token=token)
    return op


def fill_create(page: Any, instance_id: str) -> None:
    """Open the create dialog and fill a create that the test driver can do."""
    page.click("#create-open")
    page.wait_for_selector(f'#create-images option[value="{IMAGE}"]', state="attached")
    page.fill("#create-id", instance_id)
    page.fill("#create-image", IMAGE)
    page.fill("#create-cpus", "1")
    page.click("#create-dialog details summary")
    page.uncheck("#create-wait")  # no agent will enroll on the test driver


def test_a_revoked_session_returns_to_sign_in(server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            # ---- the event stream notices: the server ends it at once on revocation ---------
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            errors = PageErrors(page)
            token_id, token = operator(server, "rita")
            login(page, server.url, token)
            expect(page.locator("#feed-status")).to_have_attribute("data-state", "live")
            server.ok("DELETE", f"/api/v2/admin/tokens/{token_id}")
            expect(page.locator("#login")).to_be_visible(timeout=20_000)
            expect(page.locator("#app")).to_be_hidden()
            expect(page.locator("#login-error")).to_have_text(
                "Your session has expired or was revoked: sign in again."
            )
            screenshot(page, "dashboard-session-revoked.png")
            # recoverable: another token signs in again, and the message goes
            _id, again = operator(server, "rita")
            page.fill("#token", again)
            page.click("#login-form button[type=submit]")
            expect(page.locator("#app")).to_be_visible()
            expect(page.locator("#who")).to_have_text("rita (operator)")
            expect(page.locator("#login-error")).to_be_empty()
            errors.check()
            page.context.close()

            # ---- an API call notices (the stream is held, so only the call can) -------------
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            errors = PageErrors(page)
            page.route(
                "**/api/v1/events/stream*",
                lambda route: route.fulfill(
                    status=200,
                    headers={"Content-Type": "text/event-stream"},
                    body="retry: 600000\n\n",
                ),
            )
            token_id, token = operator(server, "rob")
            login(page, server.url, token)
            fill_create(page, "rob-1")
            server.ok("DELETE", f"/api/v2/admin/tokens/{token_id}")
            page.click("#create-submit")
            # the 401 closes the dialog (nothing stays open over the form) and says why
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#create-dialog")).to_be_hidden()
            expect(page.locator("#login-error")).to_contain_text("expired or was revoked")
            expect(page.locator("#token")).to_be_focused()
            rows = server.ok("GET", "/api/v2/admin/instances")["items"]
            assert "rob-1" not in [r["id"] for r in rows], rows
            errors.check()
        finally:
            browser.close()


def expire_web_sessions(server: ServerProcess, token_id: str) -> None:
    """Let the dashboard sessions made from a token run out now (their TTL is at least a minute):
    the server finds the cookie expired on its next request. SQLite only."""
    db = sqlite3.connect(server.data_dir / "sandbox.db", timeout=10)
    try:
        n = db.execute(
            "UPDATE web_sessions SET expires_at = created_at WHERE token_id = ?", (token_id,)
        ).rowcount
        db.commit()
    finally:
        db.close()
    assert n == 1, n


def test_an_expired_session_returns_to_sign_in(server: ServerProcess) -> None:
    """The cookie runs out while the page is open; the event stream stays up (it ends at the
    token's expiry, not the cookie's), so the next call is what notices."""
    from playwright.sync_api import expect, sync_playwright

    token_id, token = operator(server, "eve")
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            errors = PageErrors(page)
            login(page, server.url, token)
            page.wait_for_selector("body[data-loaded=app]", state="attached")
            expire_web_sessions(server, token_id)
            page.click("#instances-refresh")
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#login-error")).to_have_text(
                "Your session has expired or was revoked: sign in again."
            )
            expect(page.locator("#feed-status")).to_have_attribute("data-state", "stopped")
            expect(page.locator("#instances-error")).to_be_empty()  # no stale error behind it
            login(page, server.url, token)  # the token itself is still good
            expect(page.locator("#who")).to_have_text("eve (operator)")
            errors.check()
        finally:
            browser.close()


def test_a_failed_create_shows_its_stage_and_cause(server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    _id, token = operator(server, "fay")
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1100}).new_page()
            errors = PageErrors(page)
            login(page, server.url, token)
            fill_create(page, "fay-1")
            # the dev loadout installs packages at first boot: it needs NAT, not isolated; the
            # server knows from the request and says so at the field (nothing is created)
            page.select_option("#create-loadout", "dev")
            page.select_option("#create-network", "isolated")
            page.click("#create-submit")
            expect(page.locator("#create-network-error")).to_contain_text("needs network 'nat'")
            expect(page.locator("#create-network")).to_have_attribute("aria-invalid", "true")
            expect(page.locator("#op-progress")).to_be_hidden()
            assert (
                server.ok("GET", "/api/v2/admin/operations?subject_id=fay-1", token=token)["items"]
                == []
            )
            # more vCPUs than any host has: only placement finds out, so the operation fails
            page.select_option("#create-loadout", "minimal")
            page.fill("#create-cpus", "64")
            page.click("#create-submit")
            expect(page.locator("#op-progress")).to_be_visible()
            expect(page.locator("#op-state")).to_have_text("failed", timeout=30_000)
            op_error = page.locator("#op-error")
            expect(op_error).to_contain_text("Failed at stage placing: ")
            expect(op_error).to_contain_text("no host can take the instance")
            # the server's own words, as the API has them
            ops = server.ok("GET", "/api/v2/admin/operations?subject_id=fay-1", token=token)
            (op,) = ops["items"]
            assert op["state"] == "failed" and op["error"]["stage"] == "placing", op
            expect(op_error).to_have_text(f"Failed at stage placing: {op['error']['cause']}")
            # the stage it failed at is named and marked (also when, as here, the server failed
            # it before it reported itself as a stage); nothing is left "running…"
            expect(page.locator("#op-stage")).to_have_text("placing")
            failed = page.locator('#op-stages li[data-failed="true"]')
            expect(failed).to_have_count(1)
            expect(failed).to_have_attribute("data-stage", "placing")
            expect(failed.locator(".stage-time")).to_have_text("failed")
            expect(page.locator("#op-stages li.stage-running")).to_have_count(0)
            expect(page.locator("#op-cancel")).to_be_hidden()
            screenshot(page, "dashboard-create-failed.png")

            # "Change and retry": back to the form as it was filled, fix it, create
            again = page.locator("#op-again")
            expect(again).to_have_text("Change and retry")
            again.click()
            expect(page.locator("#create-form")).to_be_visible()
            expect(page.locator("#create-id")).to_have_value("fay-1")
            expect(page.locator("#create-network")).to_have_value("isolated")
            expect(page.locator("#create-cpus")).to_have_value("64")
            page.fill("#create-cpus", "1")
            page.select_option("#create-network", "")
            page.click("#create-submit")
            expect(page.locator("#op-state")).to_have_text("succeeded", timeout=30_000)
            expect(page.locator("#op-error")).to_be_empty()
            expect(page.locator("#op-again")).to_have_text("Create another")
            page.click("#op-close")
            expect(page.locator('#instances tr[data-instance="fay-1"]')).to_be_visible()
            errors.check()
        finally:
            browser.close()
    server.ok("DELETE", "/api/v2/admin/instances/fay-1")


def test_a_create_over_the_quota_shows_the_429_and_retry_recovers(
    server: ServerProcess,
) -> None:
    from playwright.sync_api import expect, sync_playwright

    _id, token = operator(server, "quinn")
    first = server.ok(
        "POST",
        "/api/v2/admin/instances",
        {"id": "quinn-1", "image": IMAGE, "wait_ready": False},
        token=token,
    )
    assert wait_op(server, first, token)["state"] == "succeeded"
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1100}).new_page()
            errors = PageErrors(page)
            answers: list[tuple[int, str | None]] = []
            page.on(
                "response",
                lambda r: (
                    answers.append((r.status, r.headers.get("retry-after")))
                    if r.request.method == "POST" and INSTANCES.search(r.url)
                    else None
                ),
            )
            login(page, server.url, token)
            fill_create(page, "quinn-2")
            page.click("#create-submit")
            banner = page.locator("#create-error")
            expect(banner).to_contain_text("429 Too Many Requests")
            expect(banner).to_contain_text("quinn has 1 instances (limit 1)")
            expect(banner).to_contain_text("Retry in 60 s.")
            assert answers == [(429, "60")], answers  # the server's own answer, not a fake
            expect(banner).to_have_attribute("data-kind", "rate-limited")
            expect(page.locator("#create-submit")).to_be_enabled()
            expect(page.locator("#create-id")).to_have_value("quinn-2")
            screenshot(page, "dashboard-create-429.png")
            # make room, then Retry: the same create goes through
            server.ok("DELETE", "/api/v2/admin/instances/quinn-1", token=token)
            banner.locator("button.retry").click()
            expect(page.locator("#op-progress")).to_be_visible()
            expect(page.locator("#op-subject")).to_have_text("quinn-2")
            expect(page.locator("#op-state")).to_have_text("succeeded", timeout=30_000)
            assert [a[0] for a in answers] == [429, 202], answers
            errors.check()
        finally:
            browser.close()
    server.ok("DELETE", "/api/v2/admin/instances/quinn-2")


def test_a_5xx_and_a_network_failure_on_create_then_retry(server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    _id, token = operator(server, "ivan")
    fault: dict[str, str] = {"mode": "500"}

    def on_instances(route: Any) -> None:
        if route.request.method != "POST" or fault["mode"] == "none":
            route.continue_()
        elif fault["mode"] == "500":
            route.fulfill(
                status=500,
                content_type="application/problem+json",
                body=json.dumps(
                    {
                        "title": "Internal Server Error",
                        "status": 500,
                        "detail": "internal error",
                        "request_id": "req-7f3a",
                    }
                ),
            )
        elif fault["mode"] == "502":  # a proxy in front of the server: an HTML page
            route.fulfill(status=502, content_type="text/html", body="<h1>Bad Gateway</h1>")
        else:
            route.abort("connectionrefused")

    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1100}).new_page()
            errors = PageErrors(page)
            page.route(INSTANCES, on_instances)
            login(page, server.url, token)
            fill_create(page, "ivan-1")
            banner = page.locator("#create-error")
            retry = banner.locator("button.retry")

            page.click("#create-submit")
            expect(banner).to_contain_text("The server failed (500 Internal Server Error")
            expect(banner).to_contain_text("internal error")
            expect(banner).to_contain_text("request req-7f3a")
            expect(retry).to_be_visible()
            expect(page.locator("#create-submit")).to_have_text("Create")

            fault["mode"] = "502"
            retry.click()
            expect(banner).to_contain_text("The server failed (502 Bad Gateway")

            fault["mode"] = "abort"
            retry.click()
            expect(banner).to_have_attribute("data-kind", "network")
            expect(banner).to_contain_text("The server cannot be reached (network error)")
            expect(page.locator("#create-form")).to_be_visible()
            expect(page.locator("#create-id")).to_have_value("ivan-1")
            screenshot(page, "dashboard-create-network.png")

            fault["mode"] = "none"
            retry.click()
            expect(page.locator("#op-state")).to_have_text("succeeded", timeout=30_000)
            page.click("#op-close")
            expect(page.locator('#instances tr[data-instance="ivan-1"]')).to_be_visible()
            errors.check()
        finally:
            browser.close()
    server.ok("DELETE", "/api/v2/admin/instances/ivan-1")


def test_lists_that_fail_to_load_show_it_and_retry_recovers(server: ServerProcess) -> None:
    from playwright.sync_api import expect, sync_playwright

    _id, token = operator(server, "lena")
    server.ok(
        "POST",
        "/api/v2/admin/instances",
        {"id": "lena-1", "image": IMAGE, "wait_ready": False},
        token=token,
    )
    broken = {
        # list → how it fails
        INSTANCES: lambda r: r.fulfill(
            status=500,
            content_type="application/problem+json",
            body=json.dumps({"title": "Internal Server Error", "status": 500, "detail": "boom"}),
        ),
        re.compile(r"/api/v2/admin/sessions\?"): lambda r: r.abort("connectionreset"),
        re.compile(r"/api/v2/admin/missions\?"): lambda r: r.fulfill(
            status=503, headers={"Retry-After": "7"}, body="Service Unavailable"
        ),
        re.compile(r"/api/v2/admin/operations\?"): lambda r: r.abort("internetdisconnected"),
        re.compile(r"/api/v2/admin/loadouts$"): lambda r: r.fulfill(
            status=500,
            content_type="application/problem+json",
            body=json.dumps({"title": "Internal Server Error", "status": 500, "detail": "no lo"}),
        ),
    }
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1300}).new_page()
            errors = PageErrors(page)
            for pattern, handler in broken.items():
                page.route(pattern, handler)
            login(page, server.url, token)
            page.wait_for_selector("body[data-loaded=app]", state="attached")

            inst = page.locator("#instances-error")
            expect(inst).to_contain_text("Could not load instances: The server failed (500")
            expect(inst).to_contain_text("boom")
            expect(page.locator("#instances tbody")).to_contain_text("Not loaded")
            expect(page.locator("#sessions-error")).to_contain_text(
                "Could not load sessions: The server cannot be reached"
            )
            expect(page.locator("#tasks-error")).to_contain_text(
                "Could not load tasks: Not available right now (503): Service Unavailable."
                " Retry in 7 s."
            )
            page.click("#operations-box summary")
            expect(page.locator("#operations-error")).to_contain_text(
                "Could not load operations: The server cannot be reached"
            )
            expect(page.locator("#ops-running")).to_have_text("(not loaded)")
            expect(page.locator("#loadouts-error")).to_contain_text(
                "Could not load loadouts: The server failed (500"
            )
            page.evaluate("() => window.scrollTo(0, 0)")
            screenshot(page, "dashboard-lists-failed.png")

            # a Retry while the fault lasts says so again (and does not stick on "Retrying…")
            inst.locator("button.retry").click()
            expect(inst.locator("button.retry")).to_have_text("Retry")
            expect(inst).to_contain_text("boom")

            # the faults go; each Retry recovers its list. lena-1's provision is still running,
            # so its events may refresh a list (operations, instances) before its Retry is
            # clicked: that list recovered by itself, which is right too. A Retry that is there
            # must work, and every error box must end empty.
            page.unroute_all()
            from playwright.sync_api import TimeoutError as PlaywrightTimeout

            retried = []
            for box in (
                "#instances-error",
                "#sessions-error",
                "#tasks-error",
                "#operations-error",
                "#loadouts-error",
            ):
                try:
                    page.locator(f"{box} button.retry").click(timeout=5000)
                    retried.append(box)
                except PlaywrightTimeout:
                    expect(page.locator(box)).to_be_empty()  # an event refreshed it first
                expect(page.locator(box)).to_be_empty()
            # no event of this test refreshes tasks or loadouts: their Retry did it
            assert {"#tasks-error", "#loadouts-error"} <= set(retried), retried
            expect(page.locator('#instances tr[data-instance="lena-1"]')).to_be_visible()
            expect(page.locator("#sessions tbody")).to_contain_text("No sessions yet.")
            expect(page.locator("#tasks tbody")).to_contain_text("No tasks yet.")
            expect(page.locator("#operations li").first).to_contain_text("provision lena-1")
            expect(page.locator('#loadouts tr[data-loadout="minimal"]')).to_be_visible()

            # ---- the page cannot say who is signed in: a message and a Retry, not a blank ---
            page.route("**/api/v2/admin/whoami", lambda r: r.abort("connectionrefused"))
            page.reload()
            login_error = page.locator("#login-error")
            expect(login_error).to_contain_text(
                "Could not open the dashboard: The server cannot be reached"
            )
            expect(page.locator("#login")).to_be_visible()
            page.unroute_all()
            login_error.locator("button.retry").click()
            expect(page.locator("#app")).to_be_visible()
            expect(page.locator("#who")).to_have_text("lena (operator)")
            expect(page.locator('#instances tr[data-instance="lena-1"]')).to_be_visible()
            errors.check()
        finally:
            browser.close()
    server.ok("DELETE", "/api/v2/admin/instances/lena-1")
