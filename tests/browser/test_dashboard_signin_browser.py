"""The dashboard's sign-in in a real headless Chromium: loading the page (signed out, signed in,
again and again) records no refusal of its own — the events panel an operator reads is not
filled with `auth.denied` from the page's probes — while a real refusal (a wrong token) is
still recorded, once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.browser_support import PageErrors, launch, login, require_browser
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_browser()
    srv = ServerProcess(tmp_path_factory.mktemp("signin") / "server", env=dict(TEST_SERVER_ENV))
    srv.start()
    yield srv
    srv.stop()


def denied(server: ServerProcess) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = server.ok("GET", "/api/v1/events?type=auth.denied&limit=200")[
        "items"
    ]
    return items


def settle(page: Any) -> None:
    """Until the page has made every request of its load: the sign-in form shown, or the app
    shown with its lists loaded and its event feed live. (Not `networkidle`: the feed is a
    streaming request that never ends, so whether the browser ever sees the network idle is a
    race with how soon the feed opens.)"""
    page.wait_for_load_state("load")
    page.wait_for_selector(
        "body[data-loaded=login], body[data-loaded=app][data-feed=live]", state="attached"
    )


def test_page_loads_record_no_refusals_but_a_wrong_token_does(server: ServerProcess) -> None:
    from playwright.sync_api import sync_playwright

    before = denied(server)
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context().new_page()
            errors = PageErrors(page)
            for _ in range(3):  # signed out: the sign-in form, and nothing refused
                page.goto(server.url + "/")
                settle(page)
                assert page.is_visible("#login") and not page.is_visible("#app")
            assert denied(server) == before, denied(server)[len(before) :]

            page.fill("#token", "sbx_not-a-real-token")
            page.click("#login-form button[type=submit]")
            page.wait_for_selector("#login-error:has-text('Sign-in failed')")
            deadline = time.monotonic() + 10
            while len(denied(server)) == len(before):
                assert time.monotonic() < deadline, "a wrong token is not recorded"
                time.sleep(0.1)
            wrong = denied(server)[len(before) :]
            assert len(wrong) == 1 and wrong[0]["data"]["route"].endswith("/login"), wrong
            before = denied(server)

            login(page, server.url, server.admin_token)
            for _ in range(2):  # signed in: a reload stays signed in
                page.reload()
                settle(page)
                assert page.is_visible("#app") and not page.is_visible("#login")
            page.click("#logout")
            page.wait_for_selector("#login:not([hidden])")
            for _ in range(2):  # signed out again
                page.reload()
                settle(page)
                assert page.is_visible("#login") and not page.is_visible("#app")
            assert denied(server) == before, denied(server)[len(before) :]
            errors.check()
        finally:
            browser.close()
