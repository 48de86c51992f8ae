"""Hostile JSON bodies — 200,000 nested brackets, a 5000-digit integer, NaN, a lone surrogate —
on admin, v1 and both A2A bindings: a 400 naming the problem, never a 500."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.integration.security.conftest import INSTANCE, Stack

BODIES = {
    "deep arrays": b"[" * 200_000,
    "deep objects": b'{"a":' * 100_000,
    "huge integer": b'{"subject": ' + b"9" * 5000 + b"}",
    "NaN": b'{"subject": NaN}',
    "lone surrogate": b'{"subject": "\\ud800"}',
}
SAYS = {
    "deep arrays": "nested more than",
    "deep objects": "nested more than",
    "huge integer": "out of range",
    "NaN": "not valid JSON",
    "lone surrogate": "not valid JSON",
}
ADMIN_ROUTES = [
    ("POST", "/api/v2/admin/tokens"),
    ("PUT", "/api/v2/admin/secrets/HOSTILE"),
    ("POST", "/api/v2/admin/sessions"),
    ("POST", "/api/v1/tasks"),
    ("POST", "/api/v2/admin/login"),
]


async def post(
    http: aiohttp.ClientSession, method: str, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, Any]:
    headers = {**headers, "Content-Type": "application/json"}
    async with http.request(method, url, data=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("what", list(BODIES))
async def test_hostile_bodies_are_clear_400s(stack: Stack, what: str) -> None:
    body, says = BODIES[what], SAYS[what]
    base = stack.server.url
    admin = {"Authorization": f"Bearer {stack.server.admin_token}"}
    key = {"Authorization": f"Bearer {stack.tokens['apikey']}", "A2A-Version": "1.0"}
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(
            *(post(http, m, base + p, body, admin) for m, p in ADMIN_ROUTES),
            post(http, "POST", f"{base}/agents/{INSTANCE}/message:send", body, key),
            post(http, "POST", f"{base}/agents/{INSTANCE}", body, key),
        )
    for (method, path), (status, problem) in zip(ADMIN_ROUTES, answers, strict=False):
        assert status == 400, (method, path, status, problem)
        assert problem["code"] == "bad-json" and says in problem["detail"], (path, problem)
    status, rest = answers[-2]
    assert status == 400 and rest["error"]["status"] == "INVALID_ARGUMENT", rest
    assert says in rest["error"]["message"], rest
    status, rpc = answers[-1]
    assert status == 200 and rpc["error"]["code"] == -32700 and rpc["id"] is None, rpc
    assert says in rpc["error"]["message"], rpc
    assert stack.server.alive()


async def test_a_hostile_websocket_control_frame_is_an_error_frame(stack: Stack) -> None:
    from tests.support.ptyclient import PtyClient

    session = stack.ids["session"]
    async with await PtyClient.connect(
        stack.server.ws_url, session, stack.server.admin_token
    ) as ws:
        await ws.ws.send_str("[" * 8000)
        err = await ws.wait_control("error")
        assert err["code"] == "bad-json" and "nested more than" in err["message"]
        await ws.send_json({"type": "ping", "id": 7})
        assert (await ws.wait_control("pong"))["id"] == 7  # the connection goes on
