"""Every API error is RFC 7807 problem+json naming the problem; never a traceback or HTML."""

from __future__ import annotations

import pytest

from tests.support.inproc_server import Running

PROBLEM = "application/problem+json"


def assert_problem(status: int, body: object, resp: object, expected: int) -> dict:
    assert status == expected, body
    assert resp.content_type == PROBLEM  # type: ignore[attr-defined]
    assert isinstance(body, dict)
    for key in ("type", "title", "status", "detail"):
        assert key in body, key
    assert body["status"] == expected
    assert "Traceback" not in str(body) and "<html" not in str(body).lower()
    return body


async def test_malformed_json_is_400(running: Running) -> None:
    status, body, resp = await running.call(
        "POST",
        "/api/v2/admin/tokens",
        data=b'{"subject": "a",',
        headers={"Content-Type": "application/json"},
    )
    body = assert_problem(status, body, resp, 400)
    assert "not valid JSON" in body["detail"]


async def test_wrong_type_names_the_field(running: Running) -> None:
    status, body, resp = await running.call(
        "POST", "/api/v2/admin/tokens", json={"subject": "a", "expires_in_seconds": "soon"}
    )
    body = assert_problem(status, body, resp, 422)
    assert body["errors"][0]["field"] == "body.expires_in_seconds"
    assert body["detail"].startswith("body.expires_in_seconds:")


async def test_unknown_field_is_refused_by_name(running: Running) -> None:
    status, body, resp = await running.call(
        "POST", "/api/v2/admin/tokens", json={"subject": "a", "rol": "admin"}
    )
    body = assert_problem(status, body, resp, 422)
    assert [e["field"] for e in body["errors"]] == ["body.rol"]


async def test_bad_enum_and_pattern(running: Running) -> None:
    status, body, resp = await running.call(
        "POST", "/api/v2/admin/tokens", json={"subject": "a b", "role": "root"}
    )
    body = assert_problem(status, body, resp, 422)
    assert {e["field"] for e in body["errors"]} == {"body.subject", "body.role"}


async def test_oversized_body_is_413(running: Running) -> None:
    big = b'{"subject": "' + b"a" * (80 * 1024) + b'"}'
    status, body, resp = await running.call(
        "POST", "/api/v2/admin/tokens", data=big, headers={"Content-Type": "application/json"}
    )
    body = assert_problem(status, body, resp, 413)
    assert "too large" in body["detail"]


async def test_non_json_content_type_is_415(running: Running) -> None:
    status, body, resp = await running.call(
        "POST", "/api/v2/admin/tokens", data=b"subject=a", headers={"Content-Type": "text/plain"}
    )
    assert_problem(status, body, resp, 415)


async def test_body_that_is_not_an_object(running: Running) -> None:
    status, body, resp = await running.call("POST", "/api/v2/admin/tokens", json=[1, 2])
    assert_problem(status, body, resp, 422)


async def test_bad_query_names_the_parameter(running: Running) -> None:
    status, body, resp = await running.call("GET", "/api/v1/events?limit=5000")
    body = assert_problem(status, body, resp, 422)
    assert body["errors"][0]["field"] == "query.limit"
    status, body, resp = await running.call("GET", "/api/v1/events?bogus=1")
    body = assert_problem(status, body, resp, 422)
    assert body["errors"][0]["field"] == "query.bogus"


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/api/v2/admin/nothing-here", 404),
        ("GET", "/agents/x/nothing-here", 404),
        ("PATCH", "/api/v2/admin/tokens", 405),
    ],
)
async def test_routing_errors_are_problems(
    running: Running, method: str, path: str, expected: int
) -> None:
    status, body, resp = await running.call(method, path)
    assert_problem(status, body, resp, expected)


async def test_unauthenticated_is_401_problem(running: Running) -> None:
    status, body, resp = await running.call("GET", "/api/v2/admin/tokens", token="")
    body = assert_problem(status, body, resp, 401)
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")


async def test_dashboard_is_html_not_problem(running: Running) -> None:
    status, body, resp = await running.call("GET", "/", token="")
    assert status == 200 and resp.content_type == "text/html"
    assert b"agentic-sandbox" in body


async def test_request_id_is_echoed_and_in_problem(running: Running) -> None:
    rid = "test-request-0001"
    _status, body, resp = await running.call(
        "GET", "/api/v2/admin/nothing", headers={"X-Request-Id": rid}
    )
    assert resp.headers["X-Request-Id"] == rid
    assert body["request_id"] == rid


async def test_cursor_beyond_64_bits_is_422_not_500(running: Running) -> None:
    huge = "37879526448798708873095343975170048"  # found by schemathesis: once a 500
    for path in (f"/api/v2/admin/audit?after={huge}", f"/api/v1/events?after={huge}"):
        status, body, _resp = await running.call("GET", path)
        assert status == 422, (path, body)
        assert body["errors"][0]["field"] == "query.after"
