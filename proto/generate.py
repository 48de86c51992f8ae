"""Regenerate the Python code for `proto/agent.proto`: `.venv/bin/python -m proto.generate`.

Runs grpcio-tools' bundled protoc with the mypy-protobuf plugins (typed `.pyi` stubs for the
messages and the gRPC stubs). The output is deterministic for a given grpcio-tools and
mypy-protobuf version; `tests/unit/sessions/test_proto_generated.py` regenerates into a
temporary folder and fails when the committed files differ.

The proto is compiled with the repository root as include path, so the generated gRPC module
imports `proto.agent_pb2` (a package-relative import that works installed or in a checkout).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
SOURCES = ("agent.proto",)
GENERATED = ("agent_pb2.py", "agent_pb2.pyi", "agent_pb2_grpc.py", "agent_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    """A protoc plugin from the same environment as this interpreter (or PATH)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install mypy-protobuf (pip install mypy-protobuf)")
    return found


def generate(out_root: Path) -> list[Path]:
    """Compile the protos into `out_root/proto/`; returns the generated files."""
    try:
        from grpc_tools import protoc
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit("grpcio-tools is needed: pip install grpcio-tools") from None
    import importlib.resources

    out_dir = out_root / "proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        # Compile from a copy whose only content is the .proto files, so the include path
        # (and with it every generated import and descriptor) is the same on every machine.
        src_root = Path(tmp)
        (src_root / "proto").mkdir()
        for name in SOURCES:
            shutil.copyfile(PROTO_DIR / name, src_root / "proto" / name)
        args = [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={out_root}",
            f"--mypy_grpc_out={out_root}",
            *(str(src_root / "proto" / name) for name in SOURCES),
        ]
        code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    return [out_dir / name for name in GENERATED]


def main() -> int:
    files = generate(ROOT)
    for f in files:
        print(f"wrote {f.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
