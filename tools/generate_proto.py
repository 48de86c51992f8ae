"""Regenerate the Python code for `proto/agent.proto`: `.venv/bin/python tools/generate_proto.py`.

Runs grpcio-tools' bundled protoc with the mypy-protobuf plugins (typed `.pyi` stubs for the
messages and the gRPC stubs). The output is deterministic for a given grpcio-tools and
mypy-protobuf version; `tests/unit/sessions/test_proto_generated.py` regenerates into a
temporary folder and fails when the committed files differ.

`proto/agent.proto` is the contract; its Python code lives in the package
`agentic_sandbox.proto` (a name of ours: a top-level `proto` is what proto-plus installs). The
source is compiled as `agentic_sandbox/proto/agent.proto` in a scratch include tree, so the
generated gRPC module imports `agentic_sandbox.proto.agent_pb2`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = ("agentic_sandbox", "proto")
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
    """Compile the protos into `out_root/agentic_sandbox/proto/`; returns the generated files."""
    try:
        from grpc_tools import protoc
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit("grpcio-tools is needed: pip install grpcio-tools") from None
    import importlib.resources

    out_dir = out_root.joinpath(*PACKAGE)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        # Compile from a copy whose only content is the .proto files, so the include path
        # (and with it every generated import and descriptor) is the same on every machine.
        src_root = Path(tmp)
        src_dir = src_root.joinpath(*PACKAGE)
        src_dir.mkdir(parents=True)
        for name in SOURCES:
            shutil.copyfile(PROTO_DIR / name, src_dir / name)
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
            *(str(src_dir / name) for name in SOURCES),
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
