"""The image cache on disk: layout, locks, staging + atomic publish, list/get/delete, stale cleanup.

Layout (every directory 0755, every file of a published image 0444, so that libvirt's qemu user
can read base images and nothing can write them)::

    <cache_dir>/
      images/<name>/          complete images only (appear by one atomic rename)
        disk.qcow2            the base image (backing file for per-instance overlays)
        vmlinuz, initrd.img   direct kernel boot (built images only)
        manifest.json         what the image is (see manifest.py)
        packages.txt          dpkg package list (built images only)
        build.log             the build's full log
      tmp/<name>.<token>/     builds in progress (held by a lock on tmp/<name>.<token>.lock)
      wheels/<key>/           host-side wheelhouse of the agent runtime
      debs/                   debootstrap's .deb cache (makes a rebuild download nothing)
      locks/<name>.lock       one build (or delete) of a name at a time
      logs/                   build logs of failed builds
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from agentic_sandbox.images.errors import BuildCancelled, ImageError, ImageNotFound, InvalidImage
from agentic_sandbox.images.manifest import MANIFEST_NAME, BuiltImage, read_manifest
from agentic_sandbox.images.mounts import remove_tree

NAME_RE = r"^[a-z0-9][a-z0-9.-]{0,47}-[0-9a-f]{12}$"
#: An unlocked tmp dir younger than this may belong to a build that is just starting.
STALE_GRACE_S = 30.0


def default_cache_dir() -> Path:
    """$SANDBOX_IMAGES_DIR, else $SANDBOX_DATA_DIR/images, else the data dir default + /images."""
    explicit = os.environ.get("SANDBOX_IMAGES_DIR")
    if explicit:
        return Path(explicit)
    data = os.environ.get("SANDBOX_DATA_DIR")
    if data:
        return Path(data) / "images"
    if os.geteuid() == 0:
        return Path("/var/lib/agentic-sandbox/images")
    return Path.home() / ".local/share/agentic-sandbox/images"


def _valid_name(name: str) -> bool:
    return re.fullmatch(NAME_RE, name) is not None


class ImageStore:
    """Complete images in a cache directory. Thread- and process-safe through flock."""

    def __init__(self, cache_dir: Path | str | None = None) -> None:
        self.root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.root = self.root.absolute()
        self.images_dir = self.root / "images"
        self.tmp_dir = self.root / "tmp"
        self.locks_dir = self.root / "locks"
        self.logs_dir = self.root / "logs"
        self.wheels_dir = self.root / "wheels"
        self.debs_dir = self.root / "debs"

    # ---- layout --------------------------------------------------------------------------

    def ensure_layout(self) -> None:
        for d in (self.root, self.images_dir, self.tmp_dir, self.locks_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o755)

    def image_dir(self, name: str) -> Path:
        if not _valid_name(name):
            raise ImageNotFound(f"invalid image name {name!r} (expected <recipe>-<hash12>)")
        return self.images_dir / name

    # ---- queries -------------------------------------------------------------------------

    def find(self, name: str) -> BuiltImage | None:
        """The complete image called `name`, or None (also None for an invalid/partial dir)."""
        try:
            return self.get(name)
        except ImageNotFound:
            return None

    def get(self, name: str) -> BuiltImage:
        """The complete image called `name`. Raises ImageNotFound (with the reason) otherwise."""
        path = self.image_dir(name)
        if not (path / MANIFEST_NAME).is_file():
            raise ImageNotFound(f"no image {name!r} in {self.images_dir}")
        try:
            manifest = read_manifest(path)
        except InvalidImage as err:
            raise ImageNotFound(f"image {name!r} is incomplete: {err}") from None
        if manifest.name != name:
            raise ImageNotFound(f"image {name!r} is incomplete: manifest names {manifest.name!r}")
        image = BuiltImage(path=path, manifest=manifest)
        required = [image.disk]
        if image.kernel is not None:
            required.append(image.kernel)
        if image.initrd is not None:
            required.append(image.initrd)
        for f in required:
            if not f.is_file():
                raise ImageNotFound(f"image {name!r} is incomplete: {f.name} is missing")
        if image.disk.stat().st_size != manifest.disk.actual_size:
            raise ImageNotFound(f"image {name!r} is incomplete: {image.disk.name} size differs")
        return image

    def list(self) -> list[BuiltImage]:
        """Every complete image, oldest first. Partial or foreign directories are ignored."""
        if not self.images_dir.is_dir():
            return []
        found = []
        for entry in sorted(self.images_dir.iterdir()):
            if entry.is_dir() and _valid_name(entry.name):
                image = self.find(entry.name)
                if image is not None:
                    found.append(image)
        found.sort(key=lambda i: (i.manifest.created_at, i.name))
        return found

    def latest(self, recipe_name: str) -> BuiltImage | None:
        """The newest complete image built from `recipe_name` (any hash)."""
        matches = [i for i in self.list() if i.manifest.recipe_name == recipe_name]
        return matches[-1] if matches else None

    def verify(self, name: str) -> bool:
        """Re-hash the disk and compare with the manifest (slow: reads the whole file)."""
        from agentic_sandbox.images.disk import sha256_file

        image = self.get(name)
        return sha256_file(image.disk) == image.manifest.disk.sha256

    # ---- locking -------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, name: str, cancel: threading.Event | None = None) -> Iterator[None]:
        """Exclusive lock for building/deleting `name` (flock; waits, honouring `cancel`)."""
        self.ensure_layout()
        path = self.locks_dir / f"{name}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as err:
                    if err.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if cancel is not None and cancel.is_set():
                    raise BuildCancelled("build cancelled while waiting for the image lock")
                time.sleep(0.2)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def try_lock(self, name: str) -> Iterator[bool]:
        """Like `lock()` but never waits: yields False (holding nothing) when the name is busy,
        including when this very process holds its lock (flock is per open file)."""
        self.ensure_layout()
        fd = os.open(self.locks_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                yield False
                return
            yield True
        finally:
            os.close(fd)

    # ---- staging and publishing ----------------------------------------------------------

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """A fresh tmp dir for building `name`, held by a lock for as long as the block runs.
        It is removed on exit unless it was published (renamed away) inside the block."""
        self.ensure_layout()
        token = secrets.token_hex(4)
        path = self.tmp_dir / f"{name}.{token}"
        lock_path = self.tmp_dir / f"{name}.{token}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path.mkdir(mode=0o755)
            try:
                yield path
            finally:
                if path.exists():
                    remove_tree(path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
            os.close(fd)

    def publish(self, staged: Path, name: str) -> BuiltImage:
        """Seal `staged` (files 0444, dirs 0755, fsync) and rename it to images/<name>."""
        target = self.image_dir(name)
        for dirpath, dirnames, filenames in os.walk(staged):
            os.chmod(dirpath, 0o755)
            for f in filenames:
                p = os.path.join(dirpath, f)
                if not os.path.islink(p):
                    os.chmod(p, 0o444)
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        if target.exists():
            if (target / MANIFEST_NAME).exists():
                # Never replace an image: overlays may use its disk as their backing file.
                raise ImageError(f"image {name!r} already exists; delete it first to rebuild")
            self._discard(target)  # a manifest-less leftover is never a complete image
        os.rename(staged, target)
        _fsync_dir(self.images_dir)
        return self.get(name)

    def _discard(self, path: Path) -> None:
        graveyard = self.tmp_dir / f"{path.name}.discard-{secrets.token_hex(4)}"
        os.rename(path, graveyard)
        remove_tree(graveyard)

    # ---- removal -------------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove an image (complete or not). It disappears from `list()` at once (rename).

        The caller must know that no overlay uses it as a backing file: overlays on a deleted
        base become unreadable.
        """
        path = self.image_dir(name)
        with self.lock(name):
            if not path.exists():
                raise ImageNotFound(f"no image {name!r} in {self.images_dir}")
            self._discard(path)

    def clean_stale(self, grace_s: float = STALE_GRACE_S) -> builtins.list[Path]:
        """Remove what crashed or killed builds left: unlocked tmp dirs, and image dirs without a
        manifest.json (never a complete image; an unreadable manifest is left for an operator to
        look at, since overlays may still use that disk). Returns the paths removed."""
        removed: builtins.list[Path] = []
        if self.tmp_dir.is_dir():
            for entry in sorted(self.tmp_dir.iterdir()):
                if entry.suffix == ".lock" and not entry.is_dir():
                    if not entry.with_suffix("").exists() and _unlocked(entry):
                        with contextlib.suppress(FileNotFoundError):
                            entry.unlink()
                    continue
                if not entry.is_dir():
                    continue
                lock_file = entry.parent / f"{entry.name}.lock"
                if lock_file.exists():
                    if not _unlocked(lock_file):
                        continue  # a live build owns it
                elif (
                    time.time() - entry.lstat().st_mtime < grace_s and ".discard-" not in entry.name
                ):
                    continue  # just created; its owner may not hold the lock yet
                remove_tree(entry)
                with contextlib.suppress(FileNotFoundError):
                    lock_file.unlink()
                removed.append(entry)
        if self.images_dir.is_dir():
            for entry in sorted(self.images_dir.iterdir()):
                if not entry.is_dir() or not _valid_name(entry.name):
                    continue
                if not (entry / MANIFEST_NAME).exists():
                    with self.try_lock(entry.name) as locked:
                        if locked and entry.exists() and not (entry / MANIFEST_NAME).exists():
                            self._discard(entry)
                            removed.append(entry)
        return removed


def _unlocked(lock_file: Path) -> bool:
    """True when nobody holds the flock on `lock_file`."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
