"""Tables by default; `--output json|yaml` for programs."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import yaml


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return ",".join(f"{k}={_cell(v)}" for k, v in value.items()) or "-"
    text = str(value)
    if len(text) >= 19 and text[4:5] == "-" and text[10:11] == "T":  # ISO time → shorter
        text = text[:19].replace("T", " ")
    return text


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    header = [c.upper().replace("_", " ") for c in columns]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [
        max(len(h), *(len(row[i]) for row in cells)) if cells else len(h)
        for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def emit(data: Any, fmt: str, columns: Sequence[str] | None = None) -> None:
    if fmt == "json":
        print(json.dumps(data, indent=2, sort_keys=False))
        return
    if fmt == "yaml":
        print(yaml.safe_dump(data, sort_keys=False), end="")
        return
    if columns is not None:
        rows = data.get("items", data) if isinstance(data, dict) else data
        if isinstance(rows, dict):
            rows = [rows]
        print(table(rows, columns))
        return
    if isinstance(data, dict):
        width = max((len(k) for k in data), default=0)
        for k, v in data.items():
            print(f"{k.ljust(width)}  {_cell(v)}")
        return
    print(data)


def err(message: str) -> None:
    print(f"sandboxctl: {message}", file=sys.stderr)
