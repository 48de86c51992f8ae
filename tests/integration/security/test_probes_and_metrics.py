"""What the anonymous probes tell, and who may read /metrics."""

from __future__ import annotations

import json

from tests.integration.security.conftest import Stack


async def test_anonymous_readyz_tells_status_and_checks_but_no_internals(stack: Stack) -> None:
    server = stack.server
    status, anonymous = server.api("GET", "/readyz", token="")
    assert status in (200, 503) and anonymous["status"] in ("ready", "not-ready")
    assert set(anonymous["checks"]) >= {"database", "storage", "agent-link", "libvirt"}
    for name, check in anonymous["checks"].items():
        assert set(check) == {"ok"}, (name, check)  # which passed, never why
    text = json.dumps(anonymous)
    assert "test://" not in text and "agents connected" not in text and "sqlite" not in text
    # An operator (any role) gets the details.
    status, detailed = server.api("GET", "/readyz", token=stack.tokens["viewer"])
    assert all(check["detail"] for check in detailed["checks"].values()), detailed
    assert "1 agents connected" in detailed["checks"]["agent-link"]["detail"]


async def test_metrics_take_an_operator_token_never_an_a2a_key(stack: Stack) -> None:
    server = stack.server
    status, body = server.api("GET", "/metrics", token=stack.tokens["apikey"])
    assert status == 403 and body["code"] == "forbidden-credential", body
    assert server.api("GET", "/metrics", token="")[0] == 401
    status, text = server.api("GET", "/metrics", token=stack.tokens["viewer"])
    assert status == 200 and b"sandbox_http_requests_total" in text
