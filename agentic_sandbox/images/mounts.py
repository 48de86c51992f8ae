"""Mounts inside a build tree, and removal of build trees that can never reach the host.

A build tree may hold a mounted /proc (during the venv step) or whatever debootstrap mounted
before it was killed. Removing such a tree naively would descend into the host's /proc or /dev,
so every removal goes through `remove_tree`: kill processes chrooted into the tree, unmount
everything under it (deepest first, lazily if needed), then delete without crossing devices.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from agentic_sandbox.images.errors import ImageError

_PATH_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


def _unescape_mountinfo(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    out = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Path]:
    """Mount points at or below `path`, deepest first."""
    top = os.path.realpath(path)
    found: list[str] = []
    try:
        text = mountinfo.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        mp = _unescape_mountinfo(fields[4])
        if mp == top or mp.startswith(top.rstrip("/") + "/"):
            found.append(mp)
    found.sort(key=lambda p: (p.count("/"), p), reverse=True)
    return [Path(p) for p in found]


def unmount_all(path: Path) -> None:
    """Unmount everything at or below `path`; lazily when busy. Raises if anything remains."""
    for _attempt in range(3):
        mps = mounts_under(path)
        if not mps:
            return
        for mp in mps:
            rc = subprocess.run(
                ["umount", str(mp)], env=_PATH_ENV, capture_output=True, check=False
            ).returncode
            if rc != 0:
                subprocess.run(
                    ["umount", "-l", str(mp)], env=_PATH_ENV, capture_output=True, check=False
                )
    left = mounts_under(path)
    if left:
        raise ImageError(f"cannot unmount {', '.join(map(str, left))}")


def kill_chrooted(root: Path) -> int:
    """SIGKILL every process whose root directory is `root` or below it. Returns how many."""
    top = os.path.realpath(root).rstrip("/") + "/"
    killed = 0
    for _round in range(5):
        victims = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                proc_root = os.readlink(f"/proc/{entry.name}/root")
            except OSError:
                continue
            if (proc_root.rstrip("/") + "/").startswith(top):
                victims.append(int(entry.name))
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.2)
    return killed


@contextlib.contextmanager
def mounted_proc(root: Path) -> Iterator[None]:
    """Mount /proc inside `root` for the duration of the block; always unmounts."""
    target = root / "proc"
    target.mkdir(exist_ok=True)
    subprocess.run(
        ["mount", "-t", "proc", "proc", str(target)],
        env=_PATH_ENV,
        check=True,
        capture_output=True,
    )
    try:
        yield
    finally:
        kill_chrooted(root)
        unmount_all(target)


def remove_tree(path: Path) -> None:
    """Delete `path` recursively, never leaving its filesystem (see the module docstring)."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    kill_chrooted(path)
    unmount_all(path)
    top_dev = os.lstat(path).st_dev
    for dirpath, dirnames, _files in os.walk(path, followlinks=False):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            st = os.lstat(full)
            if not os.path.islink(full) and st.st_dev != top_dev:
                raise ImageError(f"refusing to remove {path}: {full} is on another filesystem")

    # Read-only files (0444) are removable by their owner; a directory without write bits is
    # not, so fix its mode and retry once.
    def _onerror(func: object, p: str, exc_info: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o755)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    shutil.rmtree(path, onerror=_onerror)
