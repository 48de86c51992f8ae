"""The SDK's pure pieces: problem+json → exception classes, the SSE line parser, models
that keep the server's document, and the umbrella package importing nothing until used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentic_sandbox.sdk import errors
from agentic_sandbox.sdk.models import Instance, Operation
from agentic_sandbox.sdk.transport import SseEvent, _SseParser, clean_params


def problem(status: int, **extra: object) -> bytes:
    return json.dumps({"status": status, "title": "t", "detail": f"d{status}", **extra}).encode()


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, errors.ValidationFailed),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (413, errors.ValidationFailed),
        (422, errors.ValidationFailed),
        (429, errors.RateLimited),
        (500, errors.ServerError),
        (502, errors.ServerError),
        (503, errors.Unavailable),
        (418, errors.ApiError),
    ],
)
def test_status_picks_the_class(status: int, cls: type[errors.ApiError]) -> None:
    exc = errors.from_response(status, problem(status))
    assert type(exc) is cls and exc.status == status and str(exc) == f"d{status}"


def test_field_errors_and_retry_after() -> None:
    body = problem(
        422,
        code="invalid-input",
        errors=[
            {"field": "body.id", "message": "bad id", "type": "x"},
            {"field": "body.cols", "message": "too small", "type": "y"},
        ],
    )
    exc = errors.from_response(422, body)
    assert exc.fields == {"body.id": "bad id", "body.cols": "too small"}
    assert exc.code == "invalid-input"
    assert str(exc) == "d422\n  body.cols: too small"  # the detail names the first already
    limited = errors.from_response(429, problem(429), "7")
    assert isinstance(limited, errors.RateLimited) and limited.retry_after == 7.0
    assert errors.from_response(429, problem(429), "Wed, 21 Oct 2015").retry_after is None


def test_a_body_that_is_not_a_problem() -> None:
    exc = errors.from_response(502, b"<html>bad gateway</html>")
    assert isinstance(exc, errors.ServerError) and exc.problem == {}
    assert str(exc) == "HTTP 502: <html>bad gateway</html>"


def test_sse_parser() -> None:
    p = _SseParser()
    lines = [
        "retry: 2000",
        "",
        ": keepalive",
        "id: 7",
        "event: session.created",
        'data: {"a":',
        "data: 1}",
        "",
        "data: plain",
        "",
    ]
    out = [ev for line in lines if (ev := p.feed(line)) is not None]
    assert out == [
        SseEvent("session.created", '{"a":\n1}', "7"),
        SseEvent("message", "plain", "7"),  # the last id stays until another comes
    ]


def test_query_parameters() -> None:
    assert clean_params({"a": None, "b": True, "c": ["x", "y"], "d": 3}) == {
        "b": "true",
        "c": "x,y",
        "d": "3",
    }


def test_models_keep_the_document_and_accept_new_fields() -> None:
    doc = {
        "id": "vm-1",
        "state": "running",
        "agent_state": "connected",
        "created_at": "2026-01-02T03:04:05.123456+00:00",
        "from_a_newer_server": {"x": 1},
    }
    inst = Instance.model_validate(doc)
    assert inst.ready and inst.created_at is not None and inst.created_at.year == 2026
    assert inst.to_dict() == doc and list(inst.to_dict()) == list(doc)  # as sent, in order
    assert inst.model_extra == {"from_a_newer_server": {"x": 1}}
    op = Operation.model_validate({"id": "o", "kind": "provision", "state": "failed"})
    failed = errors.OperationFailed(op)
    assert str(failed) == "provision failed: failed"


def test_the_umbrella_package_imports_nothing_until_asked() -> None:
    code = (
        "import sys, agentic_sandbox as a; "
        "assert 'agentic_sandbox.sdk' not in sys.modules and 'aiohttp' not in sys.modules; "
        "from agentic_sandbox import Client; "
        "assert Client.__module__ == 'agentic_sandbox.sdk.sync'; "
        "print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.stdout.strip() == "ok", res.stderr
    with pytest.raises(AttributeError):
        import agentic_sandbox

        _ = agentic_sandbox.Nope  # type: ignore[attr-defined]


def test_every_async_call_has_its_blocking_twin() -> None:
    """A method added to an async resource without its line in the sync facade fails here."""
    import inspect

    from agentic_sandbox.sdk import sync
    from agentic_sandbox.sdk.client import AsyncClient

    client = sync.Client("http://127.0.0.1:9", "t")
    try:
        pairs = [(client, client._async)] + [
            (getattr(client, name), getattr(client._async, name))
            for name in vars(client._async)
            if not name.startswith("_") and name != "credentials"
        ]
        assert len(pairs) > 15
        for facade, target in pairs:
            public = {
                n
                for n, fn in inspect.getmembers(type(target), inspect.isfunction)
                if not n.startswith("_")
                and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))
            }
            missing = {n for n in public if not hasattr(type(facade), n)}
            assert not missing, (type(target).__name__, missing)
            for name in public:
                if isinstance(vars(type(facade)).get(name), sync._Carried):  # not close()
                    assert getattr(facade, name).__doc__ == getattr(target, name).__doc__
        assert isinstance(client._async, AsyncClient)
    finally:
        client.close()
