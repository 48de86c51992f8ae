"""The full dashboard in a real headless Chromium (Debian's), driven by Playwright.

A real server subprocess (fleet disabled, as by default) with a real host-side agent:
- sign in; the host-agent instance is listed with its state, agent state and host, and the list
  follows the event stream (a new instance appears without a reload);
- open the instance view, open a session there, type `echo dashboard-ok`, see it;
- `session.*` and `task.*` events appear in the events panel; a task's state is live;
- end the session and play its recording back (timing, pause, speed) and see its text;
- the create dialog shows field errors next to their fields and the 503 problem of a disabled
  fleet; a destructive action asks first and shows the server's refusal;
- the event stream resumes after a server restart with `Last-Event-ID` (no duplicates), and an
  `event: gap` shows a notice.
The page runs under its Content-Security-Policy and must not violate it.
Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.browser_support import (
    PLAIN_TASK_RUNNER,
    PageErrors,
    assert_csp_in_force,
    launch,
    login,
    require_browser,
    screenshot,
    wait_xterm_text,
    xterm_text,
)
from tests.support.agents import AgentProcess, register_host_instance, start_agent
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

INSTANCE = "dash-1"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, AgentProcess]]:
    require_browser()
    tmp = tmp_path_factory.mktemp("dashboard")
    server = ServerProcess(tmp / "server", env=dict(TEST_SERVER_ENV)).start()
    agent = None
    try:
        agent = start_agent(server, INSTANCE, tmp, profile=PLAIN_TASK_RUNNER)
        yield server, agent
    finally:
        if agent is not None:
            agent.stop()
        server.stop()


def _wait(pred: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_instances_session_events_tasks_and_recording(
    world: tuple[ServerProcess, AgentProcess],
) -> None:
    from playwright.sync_api import expect, sync_playwright

    server, agent = world
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1500, "height": 1300}).new_page()
            errors = PageErrors(page)
            stream_requests: list[dict[str, str]] = []
            page.on(
                "request",
                lambda req: (
                    stream_requests.append(req.headers)
                    if "/api/v1/events/stream" in req.url
                    else None
                ),
            )
            login(page, server.url, server.admin_token)
            assert_csp_in_force(page, errors)
            expect(page.locator("#feed-status")).to_have_attribute("data-state", "live")

            # ---- the instance list: state, agent state, host -------------------------------
            row = page.locator(f'#instances tr[data-instance="{INSTANCE}"]')
            expect(row.locator(".inst-state")).to_have_text("running")
            expect(row.locator(".inst-agent")).to_have_text("connected")
            expect(row.locator(".inst-host")).to_contain_text("host agent")
            # live: an instance registered elsewhere shows up without a reload
            register_host_instance(server, "dash-2")
            expect(page.locator('#instances tr[data-instance="dash-2"] .inst-agent')).to_have_text(
                "absent"
            )
            expect(page.locator('#events li[data-type="instance.created"]')).to_have_count(2)

            # ---- a session from the instance view ------------------------------------------
            row.locator("button.open-instance").click()
            view = page.locator("#instance-view")
            expect(view).to_be_visible()
            expect(page.locator("#iv-id")).to_have_text(INSTANCE)
            expect(page.locator('#iv-facts dd[data-fact="agent"]')).to_contain_text("connected")
            page.fill("#iv-command", "bash --norc --noprofile -i")
            page.fill("#iv-session-name", "dashboard demo")
            page.click("#iv-new-session button[type=submit]")
            expect(page.locator("#term-role")).to_have_text("controller")
            sid = page.evaluate("window.sandboxTerminal.session")
            page.click("#terminal")
            page.keyboard.type("echo dashboard-$((40+2))-ok")
            page.keyboard.press("Enter")
            wait_xterm_text(page, "#terminal", "dashboard-42-ok")
            page.keyboard.type("echo dashboard-ok")
            page.keyboard.press("Enter")
            wait_xterm_text(page, "#terminal", "\ndashboard-ok")
            expect(page.locator(f'#iv-sessions tr[data-session="{sid}"]')).to_contain_text(
                "dashboard demo"
            )

            # ---- session.* events in the events panel --------------------------------------
            events = page.locator("#events")
            expect(events.locator('li[data-type="session.created"]').first).to_be_visible()
            expect(events.locator('li[data-type="session.attached"]').first).to_be_visible()
            expect(events.locator('li[data-type="session.created"]').first).to_contain_text(
                f"session {sid[:8]}"
            )

            # ---- a task with live state (it runs in a PTY session on the agent) -------------
            task = server.ok(
                "POST",
                "/api/v1/tasks",
                {"instance_id": INSTANCE, "command": "echo task-ok-$((6*7))"},
            )
            task_row = page.locator(f'#tasks tr[data-task="{task["id"]}"]')
            expect(task_row).to_have_attribute("data-state", "completed", timeout=30_000)
            expect(task_row.locator(".state")).to_have_text("completed")
            expect(events.locator('li[data-family="task"]').first).to_be_visible()
            expect(page.locator('#task-totals li[data-state="completed"]')).to_contain_text("1")
            page.evaluate("() => window.scrollTo(0, 0)")
            screenshot(page, "dashboard-overview.png")

            # ---- end the session, replay its recording --------------------------------------
            page.click("#terminal")
            page.keyboard.type("exit")
            page.keyboard.press("Enter")
            expect(page.locator("#term-recording")).to_be_enabled(timeout=20_000)
            expect(events.locator('li[data-type="session.exited"]').first).to_be_visible()
            expect(page.locator(f'#sessions tr[data-session="{sid}"]')).to_have_attribute(
                "data-state", "exited"
            )
            page.click("#term-recording")
            expect(page.locator("#player-room")).to_be_visible()
            page.select_option("#player-speed", "8")
            page.wait_for_function(
                "() => window.sandboxPlayer && window.sandboxPlayer.state === 'ended'"
            )
            played = xterm_text(page, "#player-terminal")
            assert "echo dashboard-$((40+2))-ok" in played, played
            assert "\ndashboard-ok" in played, played
            # play again slowly and pause midway: the position holds still
            page.select_option("#player-speed", "0.5")
            page.click("#player-restart")
            expect(page.locator("#player-state")).to_have_text("playing")
            page.click("#player-play")
            expect(page.locator("#player-state")).to_have_text("paused")
            pos = page.evaluate("window.sandboxPlayer.position")
            time.sleep(0.5)
            assert page.evaluate("window.sandboxPlayer.position") == pos
            assert pos < page.evaluate("window.sandboxPlayer.duration")
            # seek to the end renders everything
            page.evaluate(
                "() => { const s = document.querySelector('#player-seek');"
                " s.value = s.max; s.dispatchEvent(new Event('input')); }"
            )
            wait_xterm_text(page, "#player-terminal", "dashboard-ok")
            page.locator("#player-room").scroll_into_view_if_needed()
            screenshot(page, "dashboard-recording.png")
            # the same recording from the all-sessions table
            page.click(f'#sessions tr[data-session="{sid}"] button.play-recording')
            page.wait_for_function("() => window.sandboxPlayer && window.sandboxPlayer.events > 0")

            # ---- create dialog: field errors and the disabled fleet's 503 ------------------
            page.click("#create-open")
            dialog = page.locator("#create-dialog")
            expect(dialog).to_be_visible()
            expect(page.locator("#create-loadout option")).not_to_have_count(0)
            expect(page.locator("#create-loadout-desc")).to_contain_text("Defaults")
            page.fill("#create-id", "Bad_Name")
            page.fill("#create-cpus", "0")
            page.click("#create-submit")
            expect(page.locator("#create-id-error")).to_contain_text("pattern")
            expect(page.locator("#create-id")).to_have_attribute("aria-invalid", "true")
            expect(page.locator("#create-cpus-error")).to_contain_text("greater than or equal to 1")
            expect(page.locator("#create-error")).to_contain_text("fix the 2 highlighted fields")
            screenshot(page, "dashboard-create-field-errors.png")
            page.fill("#create-id", "new-vm")
            expect(page.locator("#create-id")).not_to_have_attribute("aria-invalid", "true")
            page.fill("#create-cpus", "2")
            page.click("#create-submit")
            banner = page.locator("#create-error")
            expect(banner).to_contain_text("503")
            expect(banner).to_contain_text("the fleet is disabled (SANDBOX_LIBVIRT_URI is empty)")
            expect(page.locator("#create-id-error")).to_be_empty()
            screenshot(page, "dashboard-create-503.png")
            page.keyboard.press("Escape")
            expect(dialog).to_be_hidden()

            # ---- a destructive action asks first, then shows the server's answer ------------
            page.click('#iv-actions [data-action="delete"]')
            confirm = page.locator("#confirm-dialog")
            expect(confirm).to_be_visible()
            expect(page.locator("#confirm-title")).to_contain_text(INSTANCE)
            page.click("#confirm-cancel")
            expect(confirm).to_be_hidden()
            expect(page.locator("#iv-error")).to_be_empty()
            # a host agent has no VM: the server refuses a power action with a clear 409
            page.click('#iv-actions [data-action="stop"]')
            expect(page.locator("#iv-error")).to_contain_text("no VM")
            expect(row).to_be_visible()

            # ---- the event stream resumes with Last-Event-ID after a server restart ---------
            last = page.evaluate("window.sandboxEvents.lastEventId")
            connects = page.evaluate("window.sandboxEvents.connects")
            assert last is not None and stream_requests, stream_requests
            server.stop()
            server.start()
            page.wait_for_function(
                "(n) => window.sandboxEvents.connects > n"
                " && window.sandboxEvents.status === 'live'",
                arg=connects,
                timeout=30_000,
            )
            # (events published while the server shut down may have arrived after `last`)
            resumed = stream_requests[-1].get("last-event-id")
            assert resumed is not None and int(resumed) >= int(last), stream_requests[-1]
            register_host_instance(server, "dash-3")
            expect(page.locator('#instances tr[data-instance="dash-3"]')).to_be_visible()
            expect(events.locator('li[data-type="instance.created"]')).to_have_count(3)
            newest = server.ok("GET", "/api/v1/events?limit=1")["last_seq"]
            page.wait_for_function(
                "(n) => Number(window.sandboxEvents.lastEventId) >= n", arg=newest, timeout=10_000
            )
            seqs = events.locator("li[data-seq]").evaluate_all(
                "els => els.map(e => Number(e.dataset.seq))"
            )
            assert len(seqs) == len(set(seqs)), seqs  # nothing twice
            assert seqs == sorted(seqs, reverse=True), seqs
            # nothing lost across the restart: every event after `last` is shown
            missed = server.ok("GET", f"/api/v1/events?after={last}&limit=200")["items"]
            assert {e["seq"] for e in missed} <= set(seqs), (missed, seqs)
            agent.wait_connected()
            errors.check()
        finally:
            browser.close()


def test_event_gap_shows_a_notice(world: tuple[ServerProcess, AgentProcess]) -> None:
    """`event: gap` (the server dropped events for a slow client) is shown, and views reload."""
    from playwright.sync_api import expect, sync_playwright

    server, _agent = world
    body = (
        "retry: 600000\n\n"
        "id: 900001\nevent: session.created\n"
        'data: {"seq": 900001, "type": "session.created", "time": "2026-01-01T00:00:00+00:00",'
        ' "session_id": "feedc0de-0000", "instance_id": "dash-1", "data": {}}\n\n'
        "event: gap\n"
        'data: {"seq": 900001, "type": "stream.gap", "time": "2026-01-01T00:00:01+00:00",'
        ' "data": {"first_missed_seq": 900002, "reason": "client fell behind"}}\n\n'
    )
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            errors = PageErrors(page)
            page.route(
                "**/api/v1/events/stream*",
                lambda route: route.fulfill(
                    status=200, headers={"Content-Type": "text/event-stream"}, body=body
                ),
            )
            login(page, server.url, server.admin_token)
            expect(page.locator('#events li[data-seq="900001"]')).to_be_visible()
            notice = page.locator("#events-gap")
            expect(notice).to_be_visible()
            expect(notice).to_contain_text("from seq 900002")
            page.locator("#events-panel").screenshot(
                path=str(Path(__file__).resolve().parents[1] / "artifacts" / "dashboard-gap.png")
            )
            page.click("#events-gap-dismiss")
            expect(notice).to_be_hidden()
            errors.check()
        finally:
            browser.close()


def test_viewer_sees_but_cannot_change_and_signs_out(
    world: tuple[ServerProcess, AgentProcess],
) -> None:
    """A viewer token: lists and the event feed work, every mutating control is off; sign-out
    ends the cookie session (the page shows the login form and the API answers 401)."""
    from playwright.sync_api import expect, sync_playwright

    server, _agent = world
    sid = server.ok(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": INSTANCE, "command": ["bash", "--norc", "--noprofile", "-i"]},
    )["id"]
    viewer = server.make_token("vic", "viewer")
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            page = context.new_page()
            errors = PageErrors(page)
            login(page, server.url, viewer)
            expect(page.locator("#who")).to_have_text("vic (viewer)")
            expect(page.locator("#feed-status")).to_have_attribute("data-state", "live")
            # a viewer sees only what it owns (or what is shared): admin's instances are hidden
            expect(page.locator("#instances tbody tr.empty")).to_be_visible()
            expect(page.locator("#create-open")).to_be_disabled()
            expect(page.locator("#new-session button[type=submit]")).to_be_disabled()
            # the cookie is HttpOnly: the page's script cannot read it, and nothing is stored
            cookies = {c["name"]: c for c in context.cookies()}
            assert cookies["sbx_session"]["httpOnly"], cookies
            assert page.evaluate("() => document.cookie") == ""
            assert page.evaluate("() => localStorage.length + sessionStorage.length") == 0
            page.click("#logout")
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#app")).to_be_hidden()
            status = page.evaluate(
                "() => fetch('/api/v2/admin/whoami', {credentials: 'same-origin'})"
                ".then(r => r.status)"
            )
            assert status == 401
            errors.check()
        finally:
            browser.close()
    server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
