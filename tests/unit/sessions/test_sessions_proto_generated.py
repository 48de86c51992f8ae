"""The committed generated code is exactly what `tools/generate_proto.py` produces."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "generate_proto", ROOT / "tools/generate_proto.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    generate = _generator()
    fresh = generate.generate(tmp_path)
    for path in fresh:
        committed = ROOT / "agentic_sandbox" / "proto" / path.name
        assert committed.exists(), f"{committed} is missing: run tools/generate_proto.py"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run .venv/bin/python tools/generate_proto.py"
        )
