"""Client control messages of `sandbox.pty.v1`: strictly validated, errors name the problem."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_sandbox.broker.sessions import protocol as p


def test_valid_messages() -> None:
    assert p.parse_client_text('{"type":"resize","cols":120,"rows":40}') == p.ResizeMsg(
        type="resize", cols=120, rows=40
    )
    assert p.parse_client_text('{"type":"request_control","force":true}').force is True
    assert p.parse_client_text('{"type":"request_control"}').force is False
    assert p.parse_client_text('{"type":"release_control"}').type == "release_control"
    assert p.parse_client_text('{"type":"signal","signal":"INT"}').signal == "INT"
    assert p.parse_client_text('{"type":"ping","id":7}').id == 7


@pytest.mark.parametrize(
    ("text", "code", "needle"),
    [
        ("nope", "bad-json", "JSON"),
        ("[]", "bad-message", "object"),
        ('{"cols": 1}', "bad-message", "type"),
        ('{"type": 5}', "bad-message", "type"),
        ('{"type": "dance"}', "unknown-type", "dance"),
        ('{"type": "resize", "cols": 0, "rows": 10}', "bad-message", "resize.cols"),
        ('{"type": "resize", "cols": 10, "rows": 501}', "bad-message", "resize.rows"),
        ('{"type": "resize", "cols": "10", "rows": 10}', "bad-message", "resize.cols"),
        ('{"type": "resize", "cols": 10.0, "rows": 10}', "bad-message", "resize.cols"),
        ('{"type": "resize", "cols": 10, "rows": 10, "x": 1}', "bad-message", "resize.x"),
        ('{"type": "signal", "signal": "STOP"}', "bad-message", "signal"),
        ('{"type": "request_control", "force": 1}', "bad-message", "force"),
        ('{"type": "ping", "id": "' + "x" * 65 + '"}', "bad-message", "ping.id"),
        ('{"type": "ping", "id": "' + "x" * 9000 + '"}', "frame-too-large", "8192"),
        ("[" * 100_000, "frame-too-large", "8192"),
        ("[" * 5000, "bad-json", "JSON"),
    ],
)
def test_invalid_messages_are_named(text: str, code: str, needle: str) -> None:
    with pytest.raises(p.ProtocolError) as err:
        p.parse_client_text(text)
    assert err.value.code == code
    assert needle in err.value.message


@given(st.text(max_size=300))
def test_arbitrary_text_never_escapes_as_another_error(text: str) -> None:
    try:
        p.parse_client_text(text)
    except p.ProtocolError as exc:
        assert exc.code in ("bad-json", "bad-message", "unknown-type", "frame-too-large")


def test_server_messages_are_compact_json() -> None:
    msg = json.loads(p.error("not-controller", "no"))
    assert msg == {"type": "error", "code": "not-controller", "message": "no"}
