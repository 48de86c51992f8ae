"""The auth matrix, generated from the server's own OpenAPI document: every documented route
(plus the health probes, `/metrics`, the A2A surface and the session WebSocket) by every
credential kind (see conftest.py).

What each cell must be:
- `none` → 401 where the document asks for a role; `wrong`, `revoked` → 401 everywhere (a
  present but invalid credential is refused on every route); `apikey` → 403 everywhere outside
  `/agents/` (an A2A key is a credential only there);
- a role below the route's `x-minimum-role` → 403;
- `viewer` and `other` on alice's objects → 404 (or 422 where a body is refused first); on
  anything else → not 401/403;
- `owner` and `admin` → never 401/403 (on mutations the path names objects that do not exist,
  and bodies are invalid, so nothing of the fixture is destroyed or created);
- never a 5xx (a well-formed 503 "not ready" with `Retry-After` aside), and no answer to
  anyone but alice or the admin contains an identifier of alice's objects that the request
  did not name itself.
Streams are read until their first keepalive (the replay is over) and then closed.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.integration.security.conftest import KINDS, Stack

pytestmark = pytest.mark.timeout(300)

RANK = {None: -1, "viewer": 0, "operator": 1, "admin": 2}
KIND_RANK = {"viewer": 0, "owner": 1, "other": 1, "admin": 2}
REFUSED_EVERYWHERE = {"wrong": 401, "revoked": 401, "apikey": 403}
STRANGERS = ("none", "wrong", "revoked", "viewer", "apikey", "other")  # must see nothing of alice
INVALID_BODY = {"__not_a_field__": True}
PARALLEL = 16
STREAM_READ_SECONDS = 5.0


@dataclass
class Case:
    label: str
    kind: str
    method: str
    url: str
    role: str | None  # minimum role; None: anonymous allowed
    body: Any = None
    on_alice: bool = False  # the path names one of alice's objects
    has_body: bool = False
    stream: bool = False
    headers: dict[str, str] | None = None


@dataclass
class Answer:
    status: int
    text: str
    headers: dict[str, str]


def path_values(stack: Stack, path: str, real: bool) -> tuple[str, bool]:
    """Fill the template: alice's objects when `real`, else ids that exist nowhere."""
    ids = stack.ids
    own = {
        "instance_id": ids["instance"] if real else "sec-nobody",
        "session_id": ids["session"] if real else str(uuid.uuid4()),
        "task_id": ids["task"] if real else str(uuid.uuid4()),
        "token_id": ids["token"] if real else "0" * 16,
        "key_id": ids["key"] if real else "0" * 16,
    }
    other = {
        "operation_id": "op-" + "0" * 12,
        "key": "no-such-pool",
        "version": "1",
        "port": "0",  # not a port (422 once allowed): no cell reaches into the guest
        "path": "sandbox-auth-matrix",
    }
    parts = path.split("/")
    collection = parts[parts.index("{name}") - 1] if "{name}" in parts else ""
    if collection == "secrets":
        own["name"] = ids["secret"] if real else "NO_SUCH_SECRET"
    else:
        other["name"] = "minimal" if collection == "loadouts" else f"no-such-{collection[:-1]}"
    url, on_alice = path, False
    for name, value in own.items():
        if "{" + name + "}" in url:
            url = url.replace("{" + name + "}", value)
            on_alice = on_alice or real
    for name, value in other.items():
        url = url.replace("{" + name + "}", value)
    assert "{" not in url, f"no value for a parameter of {path}"
    return url, on_alice


def required_query(op: dict[str, Any]) -> dict[str, str]:
    """A valid value for each required query parameter, so a cell tests the role and owner
    checks rather than the query's validation (e.g. the files routes' `path`: one that does not
    exist, so no cell reads, writes or removes anything)."""
    values = {
        "string": "/sandbox-auth-matrix/no-such-path",
        "integer": "1",
        "number": "1",
        "boolean": "true",
    }
    out = {}
    for param in op.get("parameters", []):
        if param.get("in") == "query" and param.get("required"):
            out[param["name"]] = values.get(param.get("schema", {}).get("type", "string"), "x")
    return out


def openapi_cases(stack: Stack, doc: dict[str, Any], kind: str) -> list[Case]:
    cases = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            method = method.upper()
            responses = op.get("responses", {})
            if "101" in responses:
                continue  # the WebSocket: see test_session_websocket_matrix
            stream = any("text/event-stream" in r.get("content", {}) for r in responses.values())
            safe = method == "GET"
            real = safe or kind not in ("owner", "admin")
            url, on_alice = path_values(stack, path, real)
            query = required_query(op)
            if query:
                url += "?" + urllib.parse.urlencode(query)
            has_body = "requestBody" in op
            cases.append(
                Case(
                    label=f"{method} {path}",
                    kind=kind,
                    method=method,
                    url=url,
                    role=op.get("x-minimum-role"),
                    body=INVALID_BODY if has_body else None,
                    on_alice=on_alice,
                    has_body=has_body,
                    stream=stream,
                )
            )
    # Not in the document (not under /api/), same rules.
    for url, role in (("/healthz", None), ("/readyz", None), ("/metrics", "viewer")):
        cases.append(Case(f"GET {url}", kind, "GET", url, role))
    return cases


def expected(case: Case) -> set[int] | None:
    """The statuses allowed for this cell; None: anything but 401/403 (and 5xx)."""
    kind = case.kind
    if kind in REFUSED_EVERYWHERE:
        return {REFUSED_EVERYWHERE[kind]}
    if kind == "none":
        return {401} if case.role is not None else None
    if RANK[case.role] > KIND_RANK[kind]:
        return {403}
    if kind in ("viewer", "other") and case.on_alice:
        return {404, 422} if case.has_body else {404}
    return None


def judge(case: Case, answer: Answer, named: str) -> str | None:
    status, text = answer.status, answer.text
    where = f"{case.kind:8} {case.label} -> {status}"
    if status >= 500:
        retry = answer.headers.get("retry-after")
        problem = "problem+json" in answer.headers.get("content-type", "")
        not_ready = case.url == "/readyz" and '"status": "not-ready"' in text  # documented
        if not (status == 503 and (not_ready or (retry and problem))):
            return f"{where}: a 5xx: {text[:200]}"
    want = expected(case)
    if want is None:
        if status in (401, 403):
            return f"{where}: refused, but this caller may use it: {text[:200]}"
    elif status not in want:
        return f"{where}: expected {sorted(want)}: {text[:200]}"
    if case.kind in STRANGERS:
        for marker in case_markers:
            if marker not in named and marker in text:
                return f"{where}: the answer holds alice's {marker!r}: {text[:300]}"
    if "Traceback" in text:
        return f"{where}: a traceback"
    return None


case_markers: list[str] = []


async def fetch(http: aiohttp.ClientSession, base: str, stack: Stack, case: Case) -> Answer:
    headers = {**stack.headers(case.kind), **(case.headers or {})}
    kw: dict[str, Any] = {"headers": headers, "allow_redirects": False}
    if case.body is not None:
        kw["json"] = case.body
    async with http.request(case.method, base + case.url, **kw) as resp:
        if case.stream and resp.status == 200:
            text = await read_stream(resp)
        else:
            text = (await resp.read()).decode(errors="replace")
        return Answer(resp.status, text, {k.lower(): v for k, v in resp.headers.items()})


async def read_stream(resp: aiohttp.ClientResponse) -> str:
    """What an SSE stream sends until its first keepalive (the replay is done), or it ends."""
    got = bytearray()

    async def read() -> None:
        async for line in resp.content:
            got.extend(line)
            if line.startswith(b": keepalive"):
                return

    try:
        await asyncio.wait_for(read(), STREAM_READ_SECONDS)
    except TimeoutError:
        pass
    return got.decode(errors="replace")


async def run(
    stack: Stack, cases: list[Case], judge_fn: Callable[[Case, Answer, str], str | None]
) -> list[str]:
    """Every case, `PARALLEL` at a time, on one client; the failures, one line each."""
    case_markers[:] = stack.markers
    sem = asyncio.Semaphore(PARALLEL)
    failures: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def one(case: Case) -> None:
            async with sem:
                try:
                    answer = await fetch(http, stack.server.url, stack, case)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failures.append(f"{case.kind:8} {case.label}: {type(exc).__name__}: {exc}")
                    return
            named = case.url + (json.dumps(case.body) if case.body is not None else "")
            problem = judge_fn(case, answer, named)
            if problem:
                failures.append(problem)

        await asyncio.gather(*(one(c) for c in cases))
    return failures


@pytest.fixture(scope="module")
def openapi(stack: Stack) -> dict[str, Any]:
    doc: dict[str, Any] = stack.server.ok("GET", "/api/openapi.json")
    return doc


# The owner and admin run last: their cells are the ones that may change something.
@pytest.mark.parametrize("kind", sorted(KINDS, key=lambda k: k in ("owner", "admin")))
async def test_every_documented_route(stack: Stack, openapi: dict[str, Any], kind: str) -> None:
    cases = openapi_cases(stack, openapi, kind)
    assert len(cases) >= 60, "the OpenAPI document lost its routes"
    failures = await run(stack, cases, judge)
    assert not failures, f"{len(failures)} of {len(cases)} cells wrong:\n" + "\n".join(failures)
    if kind == "owner":
        # alice's own objects are all still there and hers (nothing above destroyed them).
        ids = stack.ids
        for path in (
            f"/api/v2/admin/instances/{ids['instance']}",
            f"/api/v2/admin/sessions/{ids['session']}",
            f"/api/v1/tasks/{ids['task']}",
        ):
            assert stack.server.api("GET", path, token=stack.tokens["owner"])[0] == 200, path


A2A_HEADERS = {"A2A-Version": "1.0"}


def a2a_cases(stack: Stack, kind: str) -> list[Case]:
    inst, task = stack.ids["instance"], stack.ids["task"]
    base = f"/agents/{inst}"
    cases = [
        Case("card", kind, "GET", f"{base}/.well-known/agent-card.json", None),
        Case("jwks", kind, "GET", f"{base}/.well-known/jwks.json", None),
    ]
    for label, method, url, body, stream in (
        ("ListTasks (REST)", "GET", f"{base}/tasks", None, False),
        ("GetTask (REST)", "GET", f"{base}/tasks/{task}", None, False),
        ("GetExtendedAgentCard (REST)", "GET", f"{base}/extendedAgentCard", None, False),
        ("SubscribeToTask (REST, SSE)", "GET", f"{base}/tasks/{task}:subscribe", None, True),
        (
            "GetTask (JSON-RPC)",
            "POST",
            base,
            {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task}},
            False,
        ),
        (
            "ListTasks (JSON-RPC)",
            "POST",
            base,
            {"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {}},
            False,
        ),
    ):
        cases.append(
            Case(
                label,
                kind,
                method,
                url,
                "viewer",
                body=body,
                on_alice=True,
                stream=stream,
                headers=A2A_HEADERS,
            )
        )
    return cases


def a2a_judge(case: Case, answer: Answer, named: str) -> str | None:
    where = f"{case.kind:8} {case.label} -> {answer.status}"
    kind = case.kind
    if case.role is None:  # the public card and keys
        want = {401} if kind in ("wrong", "revoked") else {200}
    elif kind in ("none", "wrong", "revoked"):
        want = {401}
    elif kind in ("viewer", "other"):
        want = {200, 404} if case.method == "POST" else {404}
    else:  # owner, admin and alice's key act for her agent
        want = set(range(200, 500)) - {401, 403}
    if answer.status not in want or answer.status >= 500:
        return f"{where}: expected {sorted(want)[:6]}: {answer.text[:200]}"
    if kind in ("viewer", "other") and case.method == "POST":
        error = json.loads(answer.text).get("error", {})
        if error.get("code") != -32001:  # TaskNotFound: "no agent here"
            return f"{where}: expected a TaskNotFound error: {answer.text[:200]}"
    if kind in STRANGERS and kind != "apikey" and case.role is not None:  # the key is alice's
        for marker in case_markers:
            if marker not in named and marker in answer.text:
                return f"{where}: the answer holds alice's {marker!r}: {answer.text[:300]}"
    return None


@pytest.mark.parametrize("kind", KINDS)
async def test_the_a2a_surface(stack: Stack, kind: str) -> None:
    failures = await run(stack, a2a_cases(stack, kind), a2a_judge)
    assert not failures, "\n".join(failures)


WS_EXPECTED = {
    "none": 401,
    "wrong": 401,
    "revoked": 401,
    "apikey": 403,
    "viewer": 404,
    "other": 404,
    "owner": 101,
    "admin": 101,
}


@pytest.mark.parametrize("kind", KINDS)
async def test_session_websocket_matrix(stack: Stack, kind: str) -> None:
    """A real WebSocket upgrade for each kind: only alice and the admin get in."""
    token = stack.tokens[kind]
    protocols = ("sandbox.pty.v1", f"bearer.{token}") if token else ("sandbox.pty.v1",)
    url = f"{stack.server.ws_url}/api/v2/admin/sessions/{stack.ids['session']}/attach"
    async with aiohttp.ClientSession() as http:
        try:
            async with http.ws_connect(url, protocols=protocols, params={"role": "observe"}) as ws:
                hello = await ws.receive_json(timeout=10)
                status = 101
                assert hello["type"] == "hello" and hello["session"] == stack.ids["session"]
        except aiohttp.WSServerHandshakeError as exc:
            status = exc.status
    assert status == WS_EXPECTED[kind]
