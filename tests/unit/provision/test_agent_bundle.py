"""The agent bundle is built from the project's own files by path and checked by importing it
in a clean interpreter (`python -I -S`) before any guest boots."""

from __future__ import annotations

import importlib.util
import io
import tarfile
from pathlib import Path

import pytest

import agentic_sandbox
from agentic_sandbox.provision.bundle import (
    MANIFEST,
    PACKAGE_ROOT,
    AgentBundle,
    BundleError,
    build_bundle,
    bundle_version,
    check_bundle,
    pack_bundle,
    project_version,
)


def _names(bundle: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
        return set(tar.getnames())


def test_the_bundle_holds_the_agent_and_its_generated_code_only() -> None:
    names = _names(build_bundle())
    assert "agentic_sandbox/__init__.py" in names
    assert "agentic_sandbox/agent/runtime.py" in names
    assert "agentic_sandbox/proto/agent_pb2.py" in names
    assert "agentic_sandbox/proto/agent_pb2_grpc.py" in names
    assert all(
        n.startswith(("agentic_sandbox/agent/", "agentic_sandbox/proto/"))
        for n in names
        if n not in ("agentic_sandbox/__init__.py", MANIFEST)
    )
    assert build_bundle() == build_bundle()  # reproducible


def test_the_bundle_names_its_version_in_its_manifest() -> None:
    bundle = build_bundle()
    assert MANIFEST in _names(bundle)
    assert bundle_version(bundle) == project_version() != ""


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"not a gzip", "not gzip"),
        (pack_bundle([("agentic_sandbox/__init__.py", b"")]), f"no {MANIFEST}"),
        (pack_bundle([(MANIFEST, b"{")]), "does not unpack"),
        (pack_bundle([(MANIFEST, b'{"version": "1.0; rm -rf /"}')]), "version string"),
        (pack_bundle([(MANIFEST, b'{"version": 3}')]), "version string"),
    ],
)
def test_a_bundle_without_a_readable_version_is_refused_naming_why(data: bytes, why: str) -> None:
    with pytest.raises(BundleError, match=why):
        bundle_version(data)


def test_the_bundle_comes_from_our_files_whatever_a_generic_name_resolves_to() -> None:
    """The user's trap: with the test extras installed, `proto` on sys.path is proto-plus
    (a2a-sdk → google-api-core → proto-plus). The bundle does not look names up."""
    spec = importlib.util.find_spec("proto")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().parent != PACKAGE_ROOT / "proto"  # proto-plus, not ours
    assert Path(agentic_sandbox.__file__).resolve().parent == PACKAGE_ROOT
    with tarfile.open(fileobj=io.BytesIO(build_bundle())) as tar:
        member = tar.extractfile("agentic_sandbox/proto/agent_pb2.py")
        assert member is not None
        assert member.read() == (PACKAGE_ROOT / "proto" / "agent_pb2.py").read_bytes()


def test_a_good_bundle_imports_in_a_clean_interpreter() -> None:
    check_bundle(build_bundle())


def _bundle_without(missing: str) -> bytes:
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(build_bundle())) as src,
        tarfile.open(fileobj=out, mode="w:gz") as dst,
    ):
        for member in src.getmembers():
            if member.name == missing:
                continue
            dst.addfile(member, src.extractfile(member))
    return out.getvalue()


def test_a_bundle_missing_its_generated_code_is_a_clear_error() -> None:
    with pytest.raises(BundleError) as err:
        check_bundle(_bundle_without("agentic_sandbox/proto/agent_pb2.py"))
    text = str(err.value)
    assert "does not import in a clean interpreter" in text
    assert "agent_pb2" in text and "Error" in text  # the traceback's last lines


def test_a_bundle_that_is_not_a_tarball_is_refused() -> None:
    with pytest.raises(BundleError, match="does not unpack"):
        check_bundle(b"not a tarball")


def test_the_check_runs_once_per_content() -> None:
    bundles = AgentBundle()
    first = bundles.checked()
    assert bundles.checked() == first
    assert len(bundles._checked) == 1


def test_the_bundle_does_not_depend_on_when_it_is_built() -> None:
    """Same files, same bytes at any time: the gzip header carries no build time (else the
    digest changes every second and each provision runs the import check again)."""
    bundle = build_bundle()
    assert bundle[:2] == b"\x1f\x8b" and bundle[4:8] == b"\0\0\0\0", bundle[:10]
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}
