"""Operator tokens, roles, ownership and the dashboard cookie."""

from __future__ import annotations

import os
import stat

from tests.support.inproc_server import Running


async def test_bootstrap_admin_token_file_is_0600(running: Running) -> None:
    path = running.svc.settings.effective_admin_token_file
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    status, body, _ = await running.call("GET", "/api/v2/admin/whoami")
    assert status == 200 and body["role"] == "admin" and body["subject"] == "admin"


async def test_token_shown_once_and_stored_hashed(running: Running) -> None:
    status, body, _ = await running.call(
        "POST", "/api/v2/admin/tokens", json={"subject": "alice", "role": "operator"}
    )
    assert status == 201 and body["token"].startswith("sbx_")
    secret = body["token"]
    status, listing, _ = await running.call("GET", "/api/v2/admin/tokens")
    assert status == 200
    assert secret not in str(listing)
    assert any(t["id"] == body["id"] and "token" not in t for t in listing["items"])
    # the database holds no plaintext either
    db_file = running.svc.settings.data_dir / "sandbox.db"
    await running.svc.events.flush()
    for f in db_file.parent.glob("sandbox.db*"):
        assert secret.encode() not in f.read_bytes()


async def test_viewer_cannot_mutate(running: Running) -> None:
    viewer = await running.make_token("vera", "viewer")
    status, body, _ = await running.call("GET", "/api/v2/admin/whoami", token=viewer)
    assert status == 200 and body["role"] == "viewer"
    status, body, resp = await running.call(
        "POST", "/api/v2/admin/tokens", token=viewer, json={"subject": "x", "role": "admin"}
    )
    assert status == 403
    assert resp.content_type == "application/problem+json"
    assert "admin role" in body["detail"]
    status, body, _ = await running.call(
        "PUT", "/api/v2/admin/secrets/API_KEY", token=viewer, json={"value": "s3cr3t-value"}
    )
    assert status == 403


async def test_revoked_token_is_refused(running: Running) -> None:
    status, body, _ = await running.call(
        "POST", "/api/v2/admin/tokens", json={"subject": "bob", "role": "operator"}
    )
    token, token_id = body["token"], body["id"]
    assert (await running.call("GET", "/api/v2/admin/whoami", token=token))[0] == 200
    status, _, _ = await running.call("DELETE", f"/api/v2/admin/tokens/{token_id}")
    assert status == 204
    status, body, resp = await running.call("GET", "/api/v2/admin/whoami", token=token)
    assert status == 401
    assert body["code"] == "invalid-token"
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")


async def test_expired_and_garbage_tokens_are_refused(running: Running) -> None:
    for bad in ("sbx_nope", "garbage", "sbx_" + "A" * 43):
        status, body, _ = await running.call("GET", "/api/v2/admin/whoami", token=bad)
        assert status == 401, bad
    status, body, _ = await running.call(
        "GET", "/api/v2/admin/whoami", token="", headers={"Authorization": "Basic Zm9vOmJhcg=="}
    )
    assert status == 401 and "Bearer" in body["detail"]


async def test_another_owners_object_is_404(running: Running) -> None:
    alice = await running.make_token("alice", "operator")
    bob = await running.make_token("bob", "operator")
    status, _, _ = await running.call(
        "PUT", "/api/v2/admin/secrets/DEPLOY_KEY", token=alice, json={"value": "alice-private-1"}
    )
    assert status == 201
    # bob sees none of alice's secrets and cannot delete hers (his own namespace has none)
    status, body, _ = await running.call("GET", "/api/v2/admin/secrets", token=bob)
    assert status == 200 and body["items"] == []
    status, body, _ = await running.call("DELETE", "/api/v2/admin/secrets/DEPLOY_KEY", token=bob)
    assert status == 404
    # bob cannot see or revoke alice's token
    status, tokens, _ = await running.call("GET", "/api/v2/admin/tokens", token=bob)
    assert {t["subject"] for t in tokens["items"]} == {"bob"}
    alice_id = next(
        t["id"]
        for t in (await running.call("GET", "/api/v2/admin/tokens"))[1]["items"]
        if t["subject"] == "alice"
    )
    status, body, _ = await running.call("DELETE", f"/api/v2/admin/tokens/{alice_id}", token=bob)
    assert status == 404 and body["code"] == "token-not-found"
    # the admin sees everything
    status, body, _ = await running.call("GET", "/api/v2/admin/secrets")
    assert [(s["owner"], s["name"]) for s in body["items"]] == [("alice", "DEPLOY_KEY")]


async def test_cookie_login_needs_csrf_for_changes(running: Running) -> None:
    import aiohttp

    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.post(
            running.url + "/api/v2/admin/login", json={"token": running.admin_token}
        ) as resp:
            assert resp.status == 200
            me = await resp.json()
            cookie = resp.cookies["sbx_session"]
            assert cookie["httponly"] and cookie["samesite"] == "Strict"
        async with browser.get(running.url + "/api/v2/admin/whoami") as resp:
            assert resp.status == 200 and (await resp.json())["kind"] == "cookie"
        body = {"subject": "carol", "role": "viewer"}
        async with browser.post(running.url + "/api/v2/admin/tokens", json=body) as resp:
            assert resp.status == 403
            assert (await resp.json())["code"] == "csrf"
        async with browser.post(
            running.url + "/api/v2/admin/tokens",
            json=body,
            headers={"X-CSRF-Token": me["csrf_token"]},
        ) as resp:
            assert resp.status == 201
        async with browser.post(
            running.url + "/api/v2/admin/logout", headers={"X-CSRF-Token": me["csrf_token"]}
        ) as resp:
            assert resp.status == 204
        async with browser.get(running.url + "/api/v2/admin/whoami") as resp:
            assert resp.status == 401


async def test_login_with_bad_token_is_401(running: Running) -> None:
    status, body, _ = await running.call(
        "POST", "/api/v2/admin/login", token="", json={"token": "sbx_wrong_wrong"}
    )
    assert status == 401 and body["code"] == "invalid-token"


async def test_denials_are_audited_and_counted(running: Running) -> None:
    viewer = await running.make_token("vera", "viewer")
    await running.call("POST", "/api/v2/admin/tokens", token=viewer, json={"subject": "x"})
    await running.call("GET", "/api/v2/admin/whoami", token="sbx_bogus_token")
    status, body, _ = await running.call("GET", "/api/v2/admin/audit?outcome=denied")
    assert status == 200
    causes = [(e["actor"], e["cause"]) for e in body["items"]]
    assert ("token:vera", "role viewer below admin") in causes
    assert any(a.startswith("anonymous@") and "invalid" in c for a, c in causes)
    status, text, _ = await running.call("GET", "/metrics")
    assert b'sandbox_auth_failures_total{reason="forbidden"} 1.0' in text
    assert b'sandbox_auth_failures_total{reason="unauthenticated"} 1.0' in text


async def test_rate_limit_gives_429_with_retry_after(tmp_path: object) -> None:
    from pathlib import Path

    from tests.support.inproc_server import make_settings, start_server

    settings = make_settings(Path(str(tmp_path)), rate_limit_per_minute=1, rate_limit_burst=3)
    async with start_server(settings) as r:
        statuses = [(await r.call("GET", "/api/v2/admin/whoami"))[0] for _ in range(4)]
        assert statuses[:3] == [200, 200, 200]
        status, body, resp = await r.call("GET", "/api/v2/admin/whoami")
        assert status == 429 and int(resp.headers["Retry-After"]) >= 1
        assert body["code"] == "rate-limited"


async def test_a2a_api_keys_do_not_open_the_admin_api(running: Running) -> None:
    from agentic_sandbox.broker.store import models as m

    async with running.svc.db.session() as s:
        s.add(m.Instance(id="inst-1", owner="admin", state="running"))
    status, key, _ = await running.call(
        "POST", "/api/v2/admin/api-keys", json={"instance_id": "inst-1", "scopes": ["a2a:read"]}
    )
    assert status == 201 and key["key"].startswith("sbk_")
    for path in ("/api/v2/admin/whoami", "/api/v2/admin/tokens", "/api/v1/events"):
        status, body, _ = await running.call("GET", path, token=key["key"])
        assert status == 403, (path, body)
        assert body["code"] == "forbidden-credential"
