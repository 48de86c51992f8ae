"""The committed generated code is exactly what `python -m proto.generate` produces."""

from __future__ import annotations

from pathlib import Path

from proto import generate


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    for path in fresh:
        committed = generate.PROTO_DIR / path.name
        assert committed.exists(), f"{committed} is missing: run python -m proto.generate"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run .venv/bin/python -m proto.generate"
        )
