"""The agent bundle: what ships into a guest to run its agent-client, and the check that it runs.

The bundle is built from the project's own files, by path: `agentic_sandbox/__init__.py` and
the `agentic_sandbox.agent` and `agentic_sandbox.proto` packages found next to this module —
never by looking a name up on `sys.path`, where another distribution's package of the same
name may come first (proto-plus installs a top-level `proto`).

`check_bundle` unpacks a bundle into a scratch directory and imports the agent from it in a
clean interpreter (`python -I -S`: no site-packages, no environment, no current directory),
whose path holds the bundle first and then the agent's runtime distributions only (grpcio,
protobuf, ptyprocess — what the guest image bakes). A broken bundle is a clear error in about a
second, with the import's traceback, instead of a guest whose agent crash-loops until the
enrollment timeout.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
from importlib import metadata
from pathlib import Path, PurePosixPath

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the `agentic_sandbox` folder
NAMESPACE = PACKAGE_ROOT.name
BUNDLED_PACKAGES = ("agent", "proto")
RUNTIME_DISTRIBUTIONS = ("grpcio", "protobuf", "ptyprocess")
CHECK_TIMEOUT = 60.0
# What the check imports and runs: the modules the guest's systemd unit starts, and the
# generated code they use.
_CHECK_PROGRAM = f"""
import sys
sys.path[:0] = sys.argv[1:]
sys.argv = ["agent-client"]
import {NAMESPACE}.agent.main, {NAMESPACE}.agent.runtime, {NAMESPACE}.proto.agent_pb2_grpc
from {NAMESPACE}.agent.config import parser
parser()
origin = {NAMESPACE}.agent.__file__
assert origin.startswith(sys.path[0]), "the agent was not imported from the bundle: " + origin
print("agent-bundle-ok")
"""


class BundleError(Exception):
    """The agent bundle cannot be built, or does not import in a clean interpreter."""


def _bundle_files() -> list[tuple[str, Path]]:
    files = [(f"{NAMESPACE}/__init__.py", PACKAGE_ROOT / "__init__.py")]
    for package in BUNDLED_PACKAGES:
        root = PACKAGE_ROOT / package
        if not (root / "__init__.py").is_file():
            raise BundleError(f"cannot build the agent bundle: {root} is not a package")
        for f in sorted(root.rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            files.append((f"{NAMESPACE}/{package}/{f.relative_to(root).as_posix()}", f))
    return files


MANIFEST = "agentic-sandbox-agent.json"  # the bundle's version (agent/upgrade.py reads it)


def project_version() -> str:
    try:
        return metadata.version("agentic-sandbox")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def build_bundle() -> bytes:
    """A reproducible tar.gz of the agent's sources and its manifest (same files → same bytes:
    every member's mtime is 0, and so is the gzip header's, which `tarfile`'s "w:gz" would set
    to now — the bundle's digest then changed every second and each provision checked it
    again)."""
    members = [(name, path.read_bytes()) for name, path in _bundle_files()]
    members.append((MANIFEST, json.dumps({"version": project_version()}).encode() + b"\n"))
    return pack_bundle(members)


def pack_bundle(members: list[tuple[str, bytes]]) -> bytes:
    """The reproducible tar.gz of `members` (name, content), in their order."""
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def bundle_digest(bundle: bytes) -> str:
    return hashlib.sha256(bundle).hexdigest()


def bundle_version(bundle: bytes) -> str:
    """The version the bundle's manifest names; `BundleError` when it is not a gzip'd tar
    with a manifest naming one (what an agent unpacks and reports, `agent/upgrade.py`)."""
    if bundle[:2] != b"\x1f\x8b":
        raise BundleError("the agent bundle is not gzip-compressed (a .tar.gz is expected)")
    try:
        with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
            member = tar.getmember(MANIFEST)
            raw = tar.extractfile(member)
            doc = json.loads(raw.read(64 * 1024)) if raw is not None else None
    except KeyError:
        raise BundleError(f"the agent bundle has no {MANIFEST}") from None
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        raise BundleError(f"the agent bundle does not unpack: {exc}") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(version, str) or not re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}", version
    ):
        raise BundleError(
            f'{MANIFEST}: "version" must be a version string (letters, digits, . + _ -)'
        )
    return version


_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def runtime_distributions() -> list[metadata.Distribution]:
    """The agent's runtime distributions and what they require (not their extras)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(RUNTIME_DISTRIBUTIONS)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise BundleError(
                f"the agent's runtime library {name!r} is not installed on the server"
            ) from None
        found[key] = dist
        for req in dist.requires or ():
            marker = req.partition(";")[2]
            match = _REQUIREMENT_NAME.match(req)
            if match and "extra" not in marker:
                todo.append(match.group(1))
    return list(found.values())


def _runtime_tree(dest: Path) -> None:
    """Link the runtime distributions' own files (and nothing else of this environment) into
    `dest`: a top-level package or module is linked whole; a namespace folder shared with other
    distributions (`google/`) is made here and only this distribution's entries linked in it."""
    for dist in runtime_distributions():
        files = [PurePosixPath(str(f)) for f in dist.files or ()]
        names = {f.as_posix() for f in files}
        linked: set[tuple[str, ...]] = set()
        for f in files:
            parts = f.parts
            if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".egg-info")):
                continue
            if parts[0] == "__pycache__":
                continue
            top = parts[0]
            if len(parts) == 1 or f"{top}/__init__.py" in names:
                key: tuple[str, ...] = (top,)
            else:  # a namespace folder: link its children of this distribution
                key = (top, parts[1])
            if key in linked:
                continue
            linked.add(key)
            source = Path(str(dist.locate_file(PurePosixPath(*key))))
            target = dest.joinpath(*key)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.symlink(source, target)


def check_bundle(bundle: bytes, *, python: str = sys.executable) -> None:
    """Import the agent from `bundle` in a clean interpreter; raise `BundleError` with the
    traceback's last lines when it does not import."""
    with tempfile.TemporaryDirectory(prefix="agent-bundle-check-") as tmp:
        app = Path(tmp) / "app"
        runtime = Path(tmp) / "runtime"
        app.mkdir()
        runtime.mkdir()
        try:
            with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
                tar.extractall(app, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise BundleError(f"the agent bundle does not unpack: {exc}") from None
        _runtime_tree(runtime)
        try:
            proc = subprocess.run(
                [python, "-I", "-S", "-c", _CHECK_PROGRAM, str(app), str(runtime)],
                capture_output=True,
                text=True,
                timeout=CHECK_TIMEOUT,
                cwd=tmp,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
            )
        except subprocess.TimeoutExpired:
            raise BundleError(
                f"importing the agent from its bundle took over {CHECK_TIMEOUT:.0f}s"
            ) from None
        except OSError as exc:
            raise BundleError(f"cannot run {python} to check the agent bundle: {exc}") from None
    if proc.returncode != 0 or "agent-bundle-ok" not in proc.stdout:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        raise BundleError(f"the agent bundle does not import in a clean interpreter:\n{tail}")


class AgentBundle:
    """The bundle a provision ships, rebuilt from the files on disk each time it is asked for
    (a few milliseconds) and checked once per distinct content."""

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def checked(self) -> bytes:
        """The current bundle, checked (blocking: call it from a thread)."""
        bundle = build_bundle()
        self.check(bundle)
        return bundle

    def check(self, bundle: bytes) -> None:
        """`check_bundle`, once per distinct content (blocking)."""
        digest = bundle_digest(bundle)
        with self._lock:
            if digest not in self._checked:
                check_bundle(bundle, python=self._python)
                self._checked.add(digest)
