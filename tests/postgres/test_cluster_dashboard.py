"""The dashboard with two control hosts (real servers on one PostgreSQL, Chromium): a page
signed in on the leader, whose node then becomes a follower (a graceful hand-over and a
restart), moves to the new leader's dashboard on its next API call — signed in still, since
the nodes share a host (cookies are per host, not per port)."""

from __future__ import annotations

from pathlib import Path

from tests.browser.browser_support import PageErrors, launch, login, require_browser
from tests.postgres.test_cluster_servers import TIMEOUT, node, roles


def test_an_open_dashboard_follows_the_leader(pg_url: str, tmp_path: Path) -> None:
    require_browser()
    from playwright.sync_api import sync_playwright

    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    try:
        n1.start(TIMEOUT)
        roles(n1)
        n2.start(TIMEOUT)
        assert roles(n1, n2)[0] is n1
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                page = browser.new_context().new_page()
                errors = PageErrors(page)
                login(page, n1.url, n1.admin_token)
                page.goto(n1.url + "/#/events")
                page.wait_for_selector("#app:not([hidden])")

                assert n1.stop(TIMEOUT) == 0  # hands over: n2 leads
                assert roles(n2)[0] is n2
                n1.start(TIMEOUT)  # back as a follower
                assert roles(n1, n2)[0] is n2

                # the page's next write-side call meets a 307: it asks /readyz and moves
                outcome = page.evaluate(
                    """() => import("/static/api.js").then((m) =>
                        m.api("/api/v2/admin/sessions").then(() => "answered",
                            (e) => `${e.status} ${e.kind} ${e.detail}`))"""
                )
                assert outcome.startswith("307 "), outcome  # the call itself says why
                page.wait_for_url(lambda url: url.startswith(n2.url), timeout=TIMEOUT * 1000)
                assert page.url == n2.url + "/#/events"
                page.wait_for_selector("#app:not([hidden])", timeout=TIMEOUT * 1000)
                errors.check()
            finally:
                browser.close()
    finally:
        n1.stop()
        n2.stop()
