"""sandboxctl's table output: nested values are sub-tables, never a Python or JSON repr."""

from __future__ import annotations

from agentic_sandbox.sandboxctl.output import _fields, _rows, render


def lines_of(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


def test_an_object_with_nested_objects_and_rows() -> None:
    op = {
        "id": "op-1",
        "state": "failed",
        "stages": [{"name": "seed", "seconds": 0.01}, {"name": "placing", "seconds": None}],
        "error": {"stage": "placing", "cause": "no host has 512 MiB free"},
        "result": {},
    }
    out = render(_fields(op))
    assert "{" not in out and "'" not in out and "name=" not in out, out
    rows = lines_of(out)
    at = next(i for i, r in enumerate(rows) if r[:1] == ["stages"])
    assert rows[at][1:] == ["NAME", "SECONDS"], out
    assert rows[at + 2][:2] == ["seed", "0.01"] and rows[at + 3][:2] == ["placing", "-"], out
    err_at = next(i for i, r in enumerate(rows) if r[:1] == ["error"])
    assert rows[err_at][1:] == ["stage", "placing"], out
    assert rows[err_at + 1] == ["cause", "no", "host", "has", "512", "MiB", "free"], out
    assert ["result", "-"] in rows, out


def test_a_list_mixing_objects_lists_and_scalars() -> None:
    doc = {"notes": [{"kind": "disk", "gib": 2}, ["a", "b"], "plain", None]}
    out = render(_fields(doc))
    assert "{" not in out and "[" not in out and "'" not in out, out
    rows = lines_of(out)
    assert rows[0] == ["notes", "-", "kind", "disk"], out
    assert rows[1] == ["gib", "2"], out  # the same item: its second field
    assert rows[2] == ["-", "a,", "b"], out
    assert rows[3] == ["-", "plain"] and rows[4] == ["-", "-"], out


def test_nested_values_inside_list_rows() -> None:
    items = [{"id": "vm-1", "labels": {"team": "infra"}, "ports": [22, 80]}]
    out = render(_rows(items, ["id", "labels", "ports"], nested=False))
    assert "{" not in out and "'" not in out, out
    rows = lines_of(out)
    assert rows[0] == ["ID", "LABELS", "PORTS"], out
    assert rows[1] == ["vm-1", "team", "infra", "22,", "80"], out
