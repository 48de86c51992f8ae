"""The OpenAPI document is valid 3.1 and matches the registered routes exactly."""

from __future__ import annotations

from openapi_spec_validator import validate

from broker.http.openapi import openapi_path
from tests.inproc import Running

API_PREFIXES = ("/api/",)


def registered_routes(running: Running) -> set[tuple[str, str]]:
    app = running.server._runners[0].app  # the real application the server serves
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter") or info.get("prefix")
        if not path or not path.startswith(API_PREFIXES) or route.method == "HEAD":
            continue
        out.add((route.method.lower(), openapi_path(path)))
    return out


async def test_openapi_is_valid_31(running: Running) -> None:
    status, doc, _ = await running.call("GET", "/api/openapi.json")
    assert status == 200
    assert doc["openapi"] == "3.1.0"
    validate(doc)


async def test_every_route_is_documented_and_vice_versa(running: Running) -> None:
    _, doc, _ = await running.call("GET", "/api/openapi.json")
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    registered = registered_routes(running)
    assert registered, "no API routes found"
    assert registered - documented == set(), "routes missing from the OpenAPI document"
    assert documented - registered == set(), "documented operations that do not exist"


async def test_protected_operations_declare_security_and_errors(running: Running) -> None:
    _, doc, _ = await running.call("GET", "/api/openapi.json")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if op["security"]:
                assert "401" in op["responses"], (method, path)
            if "requestBody" in op:
                assert "422" in op["responses"], (method, path)
