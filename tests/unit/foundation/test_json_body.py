"""Untrusted JSON: hostile documents are refused with a clear message, never an exception
a handler does not expect (RecursionError, the int-conversion ValueError)."""

from __future__ import annotations

import pytest

from agentic_sandbox.broker.http.body import MAX_DEPTH, decode_json


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[" * 200_000, f"nested more than {MAX_DEPTH} levels"),
        (b'{"a":' * 100_000, f"nested more than {MAX_DEPTH} levels"),
        (b'{"n": ' + b"9" * 5000 + b"}", "out of range"),
        (b'{"n": NaN}', "expected value"),
        (b'{"s": "\\ud800"}', "escape"),
        (b'{"s": "\xff"}', "unicode"),
        (b'{"a": 1} trailing', "trailing"),
    ],
)
def test_hostile_documents_are_value_errors_naming_the_problem(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says) as err:
        decode_json(raw)
    assert "line 1 column" in str(err.value)


def test_the_depth_limit_is_exactly_max_depth() -> None:
    ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert decode_json(ok) is not None
    with pytest.raises(ValueError):
        decode_json(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))


def test_ordinary_documents_decode_as_json_loads_would() -> None:
    doc = '{"a": [1, 2.5, "x\\u00e9", true, null, {"b": {}}], "big": 123456789012345678901234}'
    assert decode_json(doc) == {
        "a": [1, 2.5, "xé", True, None, {"b": {}}],
        "big": 123456789012345678901234,
    }
