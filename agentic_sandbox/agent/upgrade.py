"""Agent upgrades: a new agent bundle over the link, tried under the session keeper, kept or not.

The server sends a bundle (the reproducible tar.gz of `provision.bundle`: `agentic_sandbox/`
with the `agent` and `proto` packages and the `agentic-sandbox-agent.json` manifest) on a
stream of kind `agent_bundle`. The agent

1. writes it to a temporary file under `<state_dir>/bundles/` as it arrives (never whole in
   memory), hashing it; a size or SHA-256 that is not the announced one keeps nothing;
2. unpacks it with `tarstream.extract` (no absolute names, no `..`, no links out, no devices)
   into a temporary directory, checks that it holds the agent, writes the digest beside the
   code (`.bundle-digest`) and renames the directory to `bundles/<digest>`;
3. closes the stream (`AgentBundleResult`), tells its keeper to try the bundle (`trial`), and
   hands its sessions to the keeper and exits as for a planned restart.

The keeper (`keeper.py`) starts the next worker from the bundle (`PYTHONPATH`, `python -P`)
and keeps it (`bundles/current`) once that worker says it is `healthy` — it linked and heard a
heartbeat answer — within the trial's seconds. A worker that exits first, or does not get
there in time, is replaced by one from the bundle that ran before, and that worker names the
failed bundle in its registration (`Register.bundle_problem`). The server's rollout
(`broker/upgrades`) goes one instance at a time on those facts.

What a worker runs is read from its own code's folder (`running()`): the digest file the
unpacking (or the guest's first install) wrote there, and the manifest's version.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, cast

from agentic_sandbox.agent import tarstream
from agentic_sandbox.agent.keeper import PROBLEM_ENV, holds_agent
from agentic_sandbox.agent.paths import FileRefused
from agentic_sandbox.agent.streams import Inert, Stream, StreamRefused
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

KIND = "agent_bundle"
MANIFEST = "agentic-sandbox-agent.json"
DIGEST_FILE = ".bundle-digest"
MAX_BUNDLE = 64 * 1024 * 1024
DEFAULT_TRIAL = 120
MAX_TRIAL = 3600
WINDOW = 1024 * 1024
HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Running:
    digest: str  # "" when the agent runs from an installed package
    version: str


def code_root() -> Path:
    """The folder this worker's `agentic_sandbox` package was imported from."""
    return Path(__file__).resolve().parents[2]  # <root>/agentic_sandbox/agent/upgrade.py


def bundle_version(root: Path) -> str:
    try:
        version = json.loads((root / MANIFEST).read_text()).get("version", "")
    except (OSError, ValueError, AttributeError):
        version = ""
    return str(version)[:64] if isinstance(version, str) else ""


def running() -> Running:
    root = code_root()
    try:
        digest = (root / DIGEST_FILE).read_text().strip()
    except OSError:
        digest = ""
    version = bundle_version(root)
    if not version:
        try:
            version = metadata.version("agentic-sandbox")
        except metadata.PackageNotFoundError:
            version = "unknown"
    return Running(digest if HEX64.match(digest) else "", version)


def bundle_problem() -> str:
    """Why the keeper rolled the last bundle back ("" when it did not)."""
    return os.environ.pop(PROBLEM_ENV, "")[:512]


def _unpack(archive: Path, bundles: Path, digest: str) -> None:
    """`archive` into `bundles/<digest>` (a directory renamed into place when complete)."""
    final = bundles / digest
    if holds_agent(final):
        return  # unpacked before (a rollout that was tried again)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}.", dir=bundles))
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw) as source:
                tarstream.extract(
                    cast("IO[bytes]", source),  # a GzipFile reads as IO[bytes] does
                    fd,
                    chown=lambda _m: None,
                    canceled=lambda: False,
                    where=str(final),
                )
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise FileRefused(
                "bad-bundle", f"the bundle does not unpack: {exc}", "bundle"
            ) from None
        finally:
            os.close(fd)
        if not holds_agent(tmp):
            raise FileRefused(
                "bad-bundle", "the bundle holds no agentic_sandbox/agent/main.py", "bundle"
            )
        (tmp / DIGEST_FILE).write_text(digest + "\n")
        os.chmod(tmp, 0o755)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(final)  # a half-made one of an earlier try
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class BundleReceiver:
    """Channel 0: the bundle's bytes, to a temporary file; at its end, the check and unpack."""

    def __init__(
        self,
        stream: Stream,
        spec: pb.AgentBundle,
        bundles: Path,
        on_staged: Callable[[Stream, str, int], None],
        background: set[asyncio.Future[None]],
    ) -> None:
        self.stream = stream
        self.digest = spec.digest
        self.size = spec.size
        self.trial = spec.trial_seconds or DEFAULT_TRIAL
        self.bundles = bundles
        self._on_staged = on_staged
        self._background = background
        self._hash = hashlib.sha256()
        self._got = 0
        fd, name = tempfile.mkstemp(prefix=".incoming-", suffix=".tar.gz", dir=bundles)
        self._path = Path(name)
        self._file = os.fdopen(fd, "wb")
        self._done = False

    def _fail(self, code: str, message: str, field: str = "") -> None:
        self._cleanup()
        self.stream.fail(code, message, field)

    def _cleanup(self) -> None:
        self._done = True
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(OSError):
            self._path.unlink()

    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        if self._done:
            return
        if channel != 0:
            self._fail("protocol", f"data on channel {channel}: a bundle comes on channel 0")
            return
        self._got += len(data)
        if self._got > self.size:
            self._fail("bad-bundle", f"more than the announced {self.size} bytes", "size")
            return
        try:
            self._file.write(data)
        except OSError as exc:
            self._fail("no-space" if exc.errno == 28 else "io", f"{self._path}: {exc}")
            return
        self._hash.update(data)
        self.stream.consumed(0, len(data))
        if eof:
            self._done = True
            task = asyncio.ensure_future(self._finish())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _finish(self) -> None:
        try:
            self._file.close()
            if self._got != self.size:
                raise FileRefused(
                    "bad-bundle", f"{self._got} bytes, not the announced {self.size}", "size"
                )
            if self._hash.hexdigest() != self.digest:
                raise FileRefused(
                    "digest-mismatch",
                    f"the bundle's SHA-256 is {self._hash.hexdigest()}, not {self.digest}",
                    "digest",
                )
            await asyncio.to_thread(_unpack, self._path, self.bundles, self.digest)
        except FileRefused as exc:
            self._fail(exc.code, exc.message, exc.field)
            return
        except OSError as exc:
            self._fail("io", f"{self.bundles}: {exc}")
            return
        finally:
            with contextlib.suppress(OSError):
                self._path.unlink()
        log.info("agent bundle %s unpacked; trying it", self.digest[:12])
        self.stream.finish(
            pb.StreamClose(agent_bundle=pb.AgentBundleResult(digest=self.digest, restarting=True))
        )
        self._on_staged(self.stream, self.digest, self.trial)

    def on_credit(self, channel: int) -> None:
        return None

    def on_close(self, error: pb.StreamError | None) -> None:
        if not self._done:  # a cancel, or the link went: nothing stays
            self._cleanup()


def open_bundle_stream(
    bundles: Path,
    on_staged: Callable[[Stream, str, int], None],
    background: set[asyncio.Future[None]],
    stream: Stream,
    msg: pb.StreamOpen,
) -> tuple[BundleReceiver | Inert, pb.StreamAccept]:
    spec = msg.agent_bundle
    if not HEX64.match(spec.digest):
        raise StreamRefused("bad-bundle", "digest: 64 lowercase hex digits", "digest")
    if not 0 < spec.size <= MAX_BUNDLE:
        raise StreamRefused("bad-bundle", f"size: between 1 and {MAX_BUNDLE} bytes", "size")
    if spec.trial_seconds > MAX_TRIAL:
        raise StreamRefused("bad-bundle", f"trial_seconds: at most {MAX_TRIAL}", "trial_seconds")
    if running().digest == spec.digest:  # accepted, then closed at once: nothing to take
        done = pb.StreamClose(agent_bundle=pb.AgentBundleResult(digest=spec.digest))
        asyncio.get_running_loop().call_soon(stream.finish, done)
        return Inert(), pb.StreamAccept()
    try:
        bundles.mkdir(mode=0o700, parents=True, exist_ok=True)
        receiver = BundleReceiver(stream, spec, bundles, on_staged, background)
    except OSError as exc:
        raise StreamRefused("io", f"{bundles}: {exc.strerror or exc}") from None
    stream.window = WINDOW
    return receiver, pb.StreamAccept()
