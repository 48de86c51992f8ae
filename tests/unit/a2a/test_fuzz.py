"""Bad input on both bindings never gets a 5xx, a stack trace or a hang (seeded, bounded)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from tests.unit.a2a.conftest import Agent

N = 300
METHODS = [
    "SendMessage",
    "SendStreamingMessage",
    "GetTask",
    "ListTasks",
    "CancelTask",
    "SubscribeToTask",
    "CreateTaskPushNotificationConfig",
    "GetTaskPushNotificationConfig",
    "ListTaskPushNotificationConfigs",
    "DeleteTaskPushNotificationConfig",
    "GetExtendedAgentCard",
    "Nope",
]
KEYS = [
    "message",
    "messageId",
    "role",
    "parts",
    "text",
    "data",
    "raw",
    "url",
    "id",
    "taskId",
    "contextId",
    "configuration",
    "historyLength",
    "pageSize",
    "pageToken",
    "status",
    "returnImmediately",
    "metadata",
    "acceptedOutputModes",
    "token",
    "authentication",
]


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, 10**30, -(10**20)])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e-300, 3.0])
    if kind == 4:
        return rng.choice(
            ["", "x", "ROLE_USER", "TASK_STATE_WORKING", "é" * 50, "\x00", "a" * 5000]
        )
    if kind == 5:
        return rng.choice(["echo hello", "../../etc/passwd", "{}", "%s%n"])
    if kind == 6:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(KEYS): value(rng, depth + 1) for _ in range(rng.randrange(5))}


@pytest.mark.parametrize(
    "agent", [{"rate_limit_burst": 10_000, "rate_limit_per_minute": 100_000}], indirect=True
)
async def test_random_requests_never_5xx(agent: Agent) -> None:
    rng = random.Random(20261129)
    key = await agent.key(["a2a:read", "a2a:invoke"])
    headers = {"A2A-Version": "1.0", "Authorization": f"Bearer {key}"}
    paths = [
        "/message:send",
        "/tasks",
        "/tasks/x",
        "/tasks/x:cancel",
        "/tasks/x/pushNotificationConfigs",
        "/extendedAgentCard",
    ]
    async with httpx.AsyncClient(timeout=10) as http:
        for i in range(N):
            if i % 2:
                body: Any = {
                    "jsonrpc": "2.0",
                    "id": value(rng),
                    "method": rng.choice(METHODS),
                    "params": value(rng),
                }
                if rng.random() < 0.5:
                    body["params"] = {
                        "message": {"messageId": f"f{i}", "role": "ROLE_USER", "parts": value(rng)}
                    }
                r = await http.post(agent.url, json=body, headers=headers)
            else:
                path = rng.choice(paths)
                if path in ("/tasks", "/tasks/x", "/extendedAgentCard"):
                    params = {k: str(value(rng))[:50] for k in rng.sample(KEYS, 3)}
                    r = await http.get(agent.url + path, params=params, headers=headers)
                else:
                    r = await http.post(agent.url + path, json=value(rng), headers=headers)
            assert r.status_code < 500, (r.status_code, r.text[:300])
            assert "Traceback" not in r.text
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                continue
            r.json()  # always JSON
        for raw in (
            b"{",
            b"[]",
            b"NaN",
            b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": NaN}}',
        ):
            r = await http.post(
                agent.url, content=raw, headers={**headers, "Content-Type": "application/json"}
            )
            assert r.status_code == 200 and "error" in r.json()
