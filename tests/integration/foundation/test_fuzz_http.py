"""Fuzz every admin/v1/observability operation from the OpenAPI document with schemathesis on a
whole server (fleet on libvirt's test driver, a real agent): no 5xx except a well-formed 503
problem ("not ready", with Retry-After), no hang, no crash, never a traceback or HTML."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from agentic_sandbox.images import ImageStore
from tests.support.agents import AgentProcess, start_agent
from tests.support.fake_images import publish_fake
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.libvirt_testdriver import node_uri
from tests.support.server import ServerProcess

# Streams never end by themselves; image builds and pools would run real builds and boots;
# revoking tokens or logging out would end the fuzzer's own access.
EXCLUDE = re.compile(
    r"(/stream$|/logs$|/attach$|^/api/v2/admin/images$|/pools|/logout$|/tokens/\{token_id\}$)"
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    images = root / "images"
    publish_fake(ImageStore(images), "fake-0123456789ab")
    server = ServerProcess(
        root / "srv",
        env={
            **TEST_SERVER_ENV,
            "SANDBOX_LIBVIRT_URI": node_uri(root, "local"),
            "SANDBOX_IMAGES_DIR": str(images),
            "SANDBOX_KVM_PROBE": "false",
        },
    ).start()
    agent: AgentProcess = start_agent(server, "fuzz-agent", root)
    yield server
    agent.stop()
    server.stop()
    log = server.log_text()
    assert "unhandled error" not in log, "the server logged an unhandled error while fuzzed"


def check(case: schemathesis.Case, server: ServerProcess) -> None:
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {server.admin_token}"}
    response = case.call(timeout=30)
    headers = {
        k.lower(): (v[0] if isinstance(v, list) and v else v) for k, v in response.headers.items()
    }
    body = response.text
    where = f"{case.method} {case.formatted_path}"
    assert "Traceback" not in body and "<html" not in body.lower()[:200], (where, body[:500])
    if response.status_code >= 500:
        problem = response.json()
        assert response.status_code == 503, (where, response.status_code, body[:500])
        assert problem.get("code") and problem.get("detail"), (where, problem)
        assert headers.get("retry-after"), f"{where}: a 503 must say when to retry"
    if response.status_code >= 400:
        ctype = str(headers.get("content-type", ""))
        if response.status_code == 400 and not ctype and illegal_http(case):
            return  # refused by the HTTP parser itself, before any handler: not valid HTTP
        assert ctype.startswith("application/problem+json"), (where, response.status_code, ctype)


def illegal_http(case: schemathesis.Case) -> bool:
    """Control characters in the request line or headers make it invalid HTTP/1.1."""
    parts = [str(v) for v in (case.query or {}).values()]
    parts += [str(v) for v in (case.path_parameters or {}).values()]
    parts += [f"{k}={v}" for k, v in (case.cookies or {}).items()]
    parts += [str(v) for v in (case.headers or {}).values()]
    return any(ord(c) < 32 or ord(c) == 127 for part in parts for c in part)


def test_no_5xx_no_hang(fuzz_server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(
        f"{fuzz_server.url}/api/openapi.json",
        headers={"Authorization": f"Bearer {fuzz_server.admin_token}"},
    )
    tested = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if EXCLUDE.search(operation.path):
            continue

        @settings(
            max_examples=25,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def fuzz(case: schemathesis.Case) -> None:
            check(case, fuzz_server)

        fuzz()
        tested += 1
        assert fuzz_server.alive(), f"the server died fuzzing {operation.label}"
    assert tested >= 40, f"only {tested} operations fuzzed"
