"""Revoking a credential ends every WebSocket and SSE stream opened with it, at once: an
operator token (DELETE /tokens/{id}), a dashboard session (sign-out) and an A2A API key.

Nothing here waits for time to pass: each test polls, with a deadline, for what a user would
see (the close frame, the final SSE frame), and shows that input sent after the revocation never
ran by typing a second marker through another controller and seeing it arrive alone.
"""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest

from tests.integration.security.conftest import INSTANCE, Stack
from tests.support.ptyclient import PtyClient
from tests.support.sse import SseReader

pytestmark = pytest.mark.timeout(120)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_revoking_a_token_closes_its_websocket_and_streams_and_its_input_stops(
    stack: Stack,
) -> None:
    server, session = stack.server, stack.ids["session"]
    # A second token of alice's: revoking it must not touch the stack's own.
    token = server.make_token("alice", "operator")
    token_id = server.ok("GET", "/api/v2/admin/whoami", token=token)["credential_id"]
    task = server.ok(
        "POST", "/api/v1/tasks", {"instance_id": INSTANCE, "command": "sleep 60"}, token=token
    )
    ws = await PtyClient.connect(server.ws_url, session, token, role="control")
    events = await SseReader.open(f"{server.url}/api/v1/events/stream", bearer(token))
    logs = await SseReader.open(f"{server.url}/api/v1/tasks/{task['id']}/logs", bearer(token))
    admin: PtyClient | None = None
    try:
        assert ws.hello["role"] == "controller"
        await events.wait(lambda f: f.comment)  # the replay is over; the stream is live
        await logs.wait(lambda f: f.event == "state")

        assert server.api("DELETE", f"/api/v2/admin/tokens/{token_id}")[0] == 204
        # Whatever the revoked controller sends now must never reach the PTY.
        try:
            await ws.send_input(b"echo REVOKED-$((40+2))\r")
        except (ConnectionError, RuntimeError, aiohttp.ClientError):
            pass  # already closed: as good

        await ws.closed.wait()
        assert ws.close_code == 1008  # policy violation: "credential revoked"
        frame = await events.wait(lambda f: f.event == "revoked")
        assert json.loads(frame.data)["reason"] == "token revoked"
        await events.wait_ended()
        frame = await logs.wait(lambda f: f.event == "revoked")
        await logs.wait_ended()

        # Another controller types a marker; once it is echoed, everything sent before it
        # has been handled by the PTY — and the revoked controller's line is not there.
        admin = await PtyClient.connect(server.ws_url, session, server.admin_token, role="control")
        if admin.hello["role"] != "controller":
            await admin.send_json({"type": "request_control", "force": True})
            await admin.wait_control("role", pred=lambda c: c["role"] == "controller")
        await admin.send_input(b"echo ADMIN-$((2+2))\r")
        await admin.wait_output(b"ADMIN-4")
        screen = server.ok("GET", f"/api/v2/admin/sessions/{session}/screen")
        assert "REVOKED-42" not in json.dumps(screen)
        assert b"REVOKED-42" not in admin.data
        # The revoked token opens nothing new either.
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await PtyClient.connect(server.ws_url, session, token, role="observe")
        assert refused.value.status == 401
    finally:
        if admin is not None:
            await admin.send_json({"type": "release_control"})
            await admin.close()
        await ws.close()
        await events.close()
        await logs.close()
        server.api("DELETE", f"/api/v1/tasks/{task['id']}")


async def test_signing_out_ends_that_dashboard_sessions_streams_only(stack: Stack) -> None:
    server, session = stack.server, stack.ids["session"]
    token = server.make_token("alice", "operator")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.post(server.url + "/api/v2/admin/login", json={"token": token}) as r:
            assert r.status == 200
            csrf = (await r.json())["csrf_token"]
            cookie = r.cookies["sbx_session"].value
        cookies = {"sbx_session": cookie}
        by_cookie = await SseReader.open(f"{server.url}/api/v1/events/stream", cookies=cookies)
        by_token = await SseReader.open(f"{server.url}/api/v1/events/stream", bearer(token))
        ws = await PtyClient.connect(server.ws_url, session, None, cookies=cookies)
        try:
            await by_cookie.wait(lambda f: f.comment)
            await by_token.wait(lambda f: f.comment)
            async with browser.post(
                server.url + "/api/v2/admin/logout", headers={"X-CSRF-Token": csrf}
            ) as r:
                assert r.status == 204
            await ws.closed.wait()
            assert ws.close_code == 1008
            frame = await by_cookie.wait(lambda f: f.event == "revoked")
            assert json.loads(frame.data)["reason"] == "signed out"
            await by_cookie.wait_ended()
            # The token itself was not revoked: its stream goes on (its next keepalive comes).
            await by_token.wait(lambda f: f.comment, after=len(by_token.frames))
            assert not by_token.ended.is_set()
        finally:
            await ws.close()
            await by_cookie.close()
            await by_token.close()
            server.api(
                "DELETE",
                "/api/v2/admin/tokens/"
                + server.ok("GET", "/api/v2/admin/whoami", token=token)["credential_id"],
            )


async def test_revoking_an_api_key_ends_its_a2a_stream(stack: Stack) -> None:
    server, alice = stack.server, stack.tokens["owner"]
    assert alice is not None
    key = server.ok(
        "POST",
        "/api/v2/admin/api-keys",
        {"instance_id": INSTANCE, "scopes": ["a2a:read", "a2a:invoke"]},
        token=alice,
    )
    message = {
        "message": {
            "messageId": str(uuid.uuid4()),
            "role": "ROLE_USER",
            "parts": [{"text": "sleep 60"}],
        }
    }
    stream = await SseReader.open(
        f"{server.url}/agents/{INSTANCE}/message:stream",
        {**bearer(key["key"]), "A2A-Version": "1.0"},
        method="POST",
        json=message,
    )
    task_id = ""
    try:
        first = await stream.wait(lambda f: bool(f.data))
        task_id = json.loads(first.data)["task"]["id"]
        status, _ = server.api("DELETE", f"/api/v2/admin/api-keys/{key['id']}", token=alice)
        assert status == 204
        frame = await stream.wait(lambda f: f.event == "error")
        error = json.loads(frame.data)["error"]
        assert error["status"] == "UNAUTHENTICATED" and "revoked" in error["message"]
        await stream.wait_ended()
    finally:
        await stream.close()
        if task_id:
            server.api(
                "POST",
                f"/agents/{INSTANCE}/tasks/{task_id}:cancel",
                {},
                token=alice,
            )
