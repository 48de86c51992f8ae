"""The dashboard's terminal in a real headless Chromium (Debian's), driven by Playwright.

Log in with a token, attach to a session as controller, type `echo hello`, see it rendered; a
second page attaches as observer and sees it too; take control; reconnect losslessly.
Screenshots are saved under tests/artifacts/.

Opt out only explicitly: SANDBOX_SKIP_TIERS=browser (documented in the README).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.browser.browser_support import ARTIFACTS, launch, require_browser
from tests.support.agents import start_agent
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    require_browser()
    tmp = tmp_path_factory.mktemp("browser")
    server = ServerProcess(tmp / "server", env=dict(TEST_SERVER_ENV)).start()
    agent = None
    try:
        agent = start_agent(server, "browser-1", tmp)
        out = server.ok(
            "POST",
            "/api/v2/admin/sessions",
            {
                "instance_id": "browser-1",
                "command": ["bash", "--norc", "--noprofile", "-i"],
                "env": {"PS1": "PROMPT> "},
                "name": "browser demo",
            },
        )
        yield server, out["id"]
    finally:
        if agent is not None:
            agent.stop()
        server.stop()


def _terminal_text(page: object) -> str:
    return str(page.locator("#terminal .xterm-rows").inner_text())  # type: ignore[attr-defined]


def _wait_text(page: object, needle: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in _terminal_text(page):
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} not rendered; screen:\n{_terminal_text(page)}")
        time.sleep(0.1)


def _login(page: object, server: ServerProcess, token: str) -> None:
    page.goto(server.url + "/")  # type: ignore[attr-defined]
    page.fill("#token", token)  # type: ignore[attr-defined]
    page.click("#login-form button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector("#app:not([hidden])")  # type: ignore[attr-defined]


def test_attach_type_observe_take_control_and_reconnect(world: tuple[ServerProcess, str]) -> None:
    from playwright.sync_api import expect, sync_playwright

    server, sid = world
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            ctl_ctx = browser.new_context(viewport={"width": 1200, "height": 900})
            obs_ctx = browser.new_context(viewport={"width": 1200, "height": 900})
            ctl = ctl_ctx.new_page()
            obs = obs_ctx.new_page()
            errors: list[str] = []
            for page in (ctl, obs):
                page.on("pageerror", lambda exc: errors.append(str(exc)))

            _login(ctl, server, server.admin_token)
            row = ctl.locator(f'#sessions tr[data-session="{sid}"]')
            expect(row).to_contain_text("browser demo")
            row.locator("button.attach-control").click()
            expect(ctl.locator("#term-role")).to_have_text("controller")
            ctl.click("#terminal")
            ctl.keyboard.type("echo hello")
            ctl.keyboard.press("Enter")
            _wait_text(ctl, "PROMPT> echo hello")
            _wait_text(ctl, "\nhello")

            # A second browser (its own login) observes and sees what was typed.
            viewer = server.make_token("admin", "operator")
            _login(obs, server, viewer)
            obs.locator(f'#sessions tr[data-session="{sid}"] button.attach-observe').click()
            expect(obs.locator("#term-role")).to_have_text("observer")
            _wait_text(obs, "echo hello")
            expect(ctl.locator("#term-members")).to_have_attribute("data-count", "2")
            ctl.keyboard.type("echo second-$((40+2))")
            ctl.keyboard.press("Enter")
            _wait_text(obs, "second-42")
            # Typing in the observer's terminal does nothing.
            obs.click("#terminal")
            obs.keyboard.type("echo from-observer")
            obs.keyboard.press("Enter")
            time.sleep(0.5)
            assert "from-observer" not in _terminal_text(ctl)
            obs.screenshot(path=str(ARTIFACTS / "terminal-observer.png"))

            # Take control from the observer's page: roles swap.
            obs.click("#term-take")
            expect(obs.locator("#term-role")).to_have_text("controller")
            expect(ctl.locator("#term-role")).to_have_text("observer")
            obs.click("#terminal")
            obs.keyboard.type("echo third-$((1+2))")
            obs.keyboard.press("Enter")
            _wait_text(ctl, "third-3")

            # Reconnect losslessly: reattach with the last offset, nothing lost or doubled.
            before = ctl.evaluate("window.sandboxTerminal.nextOffset")
            ctl.click("#term-reconnect")
            ctl.wait_for_function(
                "(o) => window.sandboxTerminal.lastHelloFrom === o && "
                "window.sandboxTerminal.reconnects >= 1",
                arg=before,
            )
            obs.keyboard.type("echo fourth-$((2+2))")
            obs.keyboard.press("Enter")
            _wait_text(ctl, "fourth-4")
            text = _terminal_text(ctl)
            # Each line exactly once: nothing lost, nothing doubled by the reattach.
            for line in ("echo hello", "second-42", "echo third-$((1+2))", "fourth-4"):
                assert text.count(line) == 1, (line, text)
            info = server.ok("GET", f"/api/v2/admin/sessions/{sid}")
            ctl.wait_for_function(
                "(end) => window.sandboxTerminal.nextOffset >= end", arg=info["output"]["end"]
            )
            ctl.screenshot(path=str(ARTIFACTS / "terminal-controller.png"))
            assert not errors, errors
        finally:
            browser.close()
    assert (ARTIFACTS / "terminal-controller.png").stat().st_size > 1000
