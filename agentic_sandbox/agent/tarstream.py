"""Directories as tar streams (stdlib `tarfile` in streaming mode: `r|` / `w|`).

Unpacking trusts nothing in the archive: `member_parts()` refuses absolute names, `..`
components and NUL bytes, hard links, devices and FIFOs, and symlinks whose target is absolute
or leads out of the tree. Members are written under the destination's directory fd with
`openat`-style calls (`dir_fd=`) and `O_NOFOLLOW | O_EXCL`: a symlink member can never be
written through, and a name that repeats is refused. Modes are kept (permission bits), owners
kept when the agent runs as root (by name when the name exists here, else the default), mtimes
kept; each file is fsynced before the next.

Packing walks the tree by directory fds, never following a symlink (a symlink is stored as
one), and skips sockets and devices.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import tarfile
from collections.abc import Callable
from typing import IO

from agentic_sandbox.agent.paths import (
    DIR_FLAGS,
    FileRefused,
    group_name,
    open_dir_at,
    refusal,
    user_name,
)

BUF = 1024 * 1024
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def bad(message: str) -> FileRefused:
    return FileRefused("bad-tar", message, "body")


def member_parts(m: tarfile.TarInfo) -> list[str]:
    """The member's path inside the tree as components ([] for the tree's root entry), or
    `bad-tar` naming the member and why."""
    name = m.name
    if "\x00" in name or name.startswith("/"):
        raise bad(f"member {name!r}: absolute names are not accepted")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise bad(f"member {name!r}: '..' components are not accepted")
    if m.islnk():
        raise bad(f"member {name!r}: hard links are not accepted")
    if m.issym():
        target = m.linkname
        if not target or target.startswith("/") or "\x00" in target:
            raise bad(f"member {name!r}: a symlink to {target!r} (absolute) is not accepted")
        resolved = posixpath.normpath(posixpath.join(*(parts[:-1] or ["."]), target))
        if resolved == ".." or resolved.startswith("../"):
            raise bad(f"member {name!r}: a symlink to {target!r} leads out of the tree")
    elif not (m.isreg() or m.isdir()):
        raise bad(f"member {name!r}: only files, directories and symlinks are accepted")
    if not parts and not m.isdir():
        raise bad(f"member {name!r}: an empty name")
    return parts


def _dir_under(root_fd: int, parts: list[str], where: str) -> int:
    """The directory `parts` under the tree's root (made when missing), never via a symlink."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise refusal(exc, where) from None
            nfd = open_dir_at(fd, part, where)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def extract(
    source: IO[bytes],
    root_fd: int,
    *,
    chown: Callable[[tarfile.TarInfo], tuple[int, int] | None],
    canceled: Callable[[], bool],
    where: str,
) -> int:
    """Unpack the tar stream `source` into the (new, empty) directory `root_fd`; the member
    count. `chown` gives a member's uid/gid (None: leave as created)."""
    count = 0
    dirs: list[tuple[list[str], tarfile.TarInfo]] = []
    try:
        tar = tarfile.open(fileobj=source, mode="r|", bufsize=BUF)  # noqa: SIM115 (with below)
    except tarfile.TarError as exc:
        raise bad(f"not a tar stream: {exc}") from None
    with tar:
        try:
            for m in tar:
                if canceled():
                    raise FileRefused("canceled", "the upload was cancelled")
                parts = member_parts(m)
                count += 1
                if not parts:
                    dirs.append((parts, m))
                    continue
                at = posixpath.join(where, *parts)
                parent = _dir_under(root_fd, parts[:-1], at)
                try:
                    _member(tar, m, parent, parts[-1], chown, at, dirs, parts)
                finally:
                    os.close(parent)
        except tarfile.TarError as exc:
            raise bad(f"the tar stream is broken: {exc}") from None
    for parts, m in reversed(dirs):  # last: a read-only directory is filled first
        fd = _dir_under(root_fd, parts, posixpath.join(where, *parts))
        try:
            os.fchmod(fd, m.mode & 0o7777)
            ids = chown(m)
            if ids is not None:
                os.fchown(fd, *ids)
            os.utime(fd, ns=(int(m.mtime * 1e9), int(m.mtime * 1e9)))
        finally:
            os.close(fd)
    return count


def _member(
    tar: tarfile.TarFile,
    m: tarfile.TarInfo,
    parent: int,
    name: str,
    chown: Callable[[tarfile.TarInfo], tuple[int, int] | None],
    at: str,
    dirs: list[tuple[list[str], tarfile.TarInfo]],
    parts: list[str],
) -> None:
    try:
        if m.isdir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent)
            os.close(open_dir_at(parent, name, at))  # a directory, not a symlink
            dirs.append((parts, m))
        elif m.issym():
            os.symlink(m.linkname, name, dir_fd=parent)
            ids = chown(m)
            if ids is not None:
                os.chown(name, *ids, dir_fd=parent, follow_symlinks=False)
        else:
            fd = os.open(name, FILE_FLAGS, 0o600, dir_fd=parent)
            try:
                src = tar.extractfile(m)
                if src is not None:
                    while chunk := src.read(BUF):
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view) :]
                os.fchmod(fd, m.mode & 0o7777)
                ids = chown(m)
                if ids is not None:
                    os.fchown(fd, *ids)
                os.utime(fd, ns=(int(m.mtime * 1e9), int(m.mtime * 1e9)))
                os.fsync(fd)
            finally:
                os.close(fd)
    except FileExistsError:
        raise bad(f"member {m.name!r}: the name repeats") from None
    except OSError as exc:
        raise refusal(exc, at) from None


def pack(root_fd: int, out: IO[bytes], *, canceled: Callable[[], bool], where: str) -> int:
    """Write the tree under `root_fd` as a tar stream to `out`; the member count."""
    count = 0
    with tarfile.open(fileobj=out, mode="w|", bufsize=BUF, format=tarfile.PAX_FORMAT) as tar:

        def add(fd: int, rel: str, st: os.stat_result) -> None:
            nonlocal count
            info = tarfile.TarInfo(rel or ".")
            info.mode = stat.S_IMODE(st.st_mode)
            info.uid, info.gid = st.st_uid, st.st_gid
            info.uname, info.gname = user_name(st.st_uid), group_name(st.st_gid)
            info.mtime = st.st_mtime
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
            count += 1
            with os.scandir(fd) as entries:
                names = sorted(e.name for e in entries)
            for name in names:
                if canceled():
                    raise FileRefused("canceled", "the download was cancelled")
                child = posixpath.join(rel, name) if rel else name
                at = posixpath.join(where, child)
                try:
                    est = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone since the listing
                except OSError as exc:
                    raise refusal(exc, at) from None
                if stat.S_ISDIR(est.st_mode):
                    cfd = open_dir_at(fd, name, at)
                    try:
                        add(cfd, child, est)
                    finally:
                        os.close(cfd)
                elif stat.S_ISLNK(est.st_mode):
                    info = _info(child, est)
                    info.type = tarfile.SYMTYPE
                    info.linkname = os.readlink(name, dir_fd=fd)
                    tar.addfile(info)
                    count += 1
                elif stat.S_ISREG(est.st_mode):
                    try:
                        ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    except OSError as exc:
                        raise refusal(exc, at) from None
                    with os.fdopen(ffd, "rb", buffering=0) as f:
                        fst = os.fstat(f.fileno())
                        info = _info(child, fst)
                        info.size = fst.st_size
                        tar.addfile(info, f)
                    count += 1

        add(root_fd, "", os.fstat(root_fd))
    return count


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.uname, info.gname = user_name(st.st_uid), group_name(st.st_gid)
    info.mtime = st.st_mtime
    return info


__all__ = ["BUF", "DIR_FLAGS", "extract", "member_parts", "pack"]
