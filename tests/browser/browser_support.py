"""Shared pieces of the browser tier (imported by its tests): Debian's Chromium + Playwright.

- `launch(pw)` starts Chromium with the flags the environment needs;
- `login(page, server, token)` signs in through the page's form;
- `assert_csp_in_force(page, errors)` checks the page runs under its Content-Security-Policy
  (so a test fails if the page relies on anything the CSP forbids: `PageErrors` records
  violations);
- `PageErrors` collects uncaught page errors and CSP violations.

Opt out only explicitly: SANDBOX_SKIP_TIERS=browser (documented in the README).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def require_browser() -> None:
    """The tier runs or fails: opting out is scripts/test.sh's job (SANDBOX_SKIP_TIERS), which
    then does not start pytest here at all."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (or opt out explicitly)")


def launch(pw: Any) -> Any:
    return pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)


class PageErrors:
    """Uncaught exceptions and CSP violations of a page (console errors about CSP included)."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", self._console)

    def _console(self, msg: Any) -> None:
        text = str(msg.text)
        if "Content Security Policy" in text or "Content-Security-Policy" in text:
            self.errors.append(f"csp: {text}")

    def check(self) -> None:
        assert not self.errors, self.errors


def assert_csp_in_force(page: Any, errors: PageErrors) -> None:
    """The page runs under the CSP: an injected inline script is refused (and reported)."""
    outcome = page.evaluate(
        """() => new Promise((resolve) => {
            document.addEventListener("securitypolicyviolation",
                (e) => resolve("blocked:" + e.violatedDirective), { once: true });
            const s = document.createElement("script");
            s.textContent = "window.__inlineRan = true";
            document.body.append(s);
            setTimeout(() => resolve(window.__inlineRan ? "ran" : "silent"), 1000);
        })"""
    )
    assert str(outcome).startswith("blocked:script-src"), outcome
    # that probe's own violation is expected; anything else stays an error
    errors.errors = [e for e in errors.errors if "inline script" not in e]


def login(page: Any, base_url: str, token: str) -> None:
    page.goto(base_url + "/")
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#app:not([hidden])")


def xterm_text(page: Any, container: str) -> str:
    return str(page.locator(f"{container} .xterm-rows").inner_text())


def wait_xterm_text(page: Any, container: str, needle: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in xterm_text(page, container):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{needle!r} not rendered in {container}; screen:\n{xterm_text(page, container)}"
            )
        time.sleep(0.1)


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path))
    assert path.stat().st_size > 1000
    return path


# Tasks run with `bash -c` (no login shell): a login shell on the host would read the machine
# user's profile (slow, or hanging on some machines). Declared when the host instance is
# registered (`start_agent(..., profile=PLAIN_TASK_RUNNER)`), as a user would.
PLAIN_TASK_RUNNER: dict[str, object] = {
    "task_runner": {"argv": ["bash", "--norc", "--noprofile", "-c", "{text}"]}
}
