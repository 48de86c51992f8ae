"""The OpenAPI document is valid 3.1 and matches the registered routes exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from openapi_spec_validator import validate

from agentic_sandbox.broker.components import build_components
from agentic_sandbox.broker.http.openapi import openapi_path
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import node_uri


@pytest.fixture
async def full(tmp_path: Path) -> AsyncIterator[Running]:
    """The whole server: every component's routes (fleet on libvirt's test driver)."""
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    async with start_server(settings, components=build_components) as r:
        yield r


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


async def test_openapi_is_valid_31(full: Running) -> None:
    status, doc, _ = await full.call("GET", "/api/openapi.json")
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


async def test_protected_operations_declare_security_and_errors(full: Running) -> None:
    _, doc, _ = await full.call("GET", "/api/openapi.json")
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if op["security"]:
                assert "401" in op["responses"], (method, path)
            if "requestBody" in op:
                assert "422" in op["responses"], (method, path)
