"""Paths of file streams: checked as strings, then resolved one component at a time.

A path from the server is untrusted. `split()` refuses what is not absolute, has an empty,
`.` or `..` component, a NUL byte, or is too long. `Resolver.parent()` then opens the path's
directories from `/` down with `openat` (`os.open(name, dir_fd=…)`) and `O_NOFOLLOW`, so a
symlink anywhere on the way is refused (`symlink`) — a string check alone cannot see one —
unless the request asked to follow symlinks. What it returns is a directory fd and the last
name: every operation after that is relative to the fd (`dir_fd=`), so a path swapped
underneath cannot send it elsewhere.

Errors are `FileRefused(code, message)` naming the path and the reason: `bad-path`,
`not-found`, `not-a-directory`, `is-a-directory`, `symlink`, `exists`, `not-empty`,
`permission`, `no-space`, `io`.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from dataclasses import dataclass

from agentic_sandbox.agent.streams import StreamRefused

MAX_PATH = 4096
MAX_NAME = 255
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class FileRefused(StreamRefused):
    """A file operation that cannot be done; `field` is always the path."""

    def __init__(self, code: str, message: str, field: str = "path") -> None:
        super().__init__(code, message, field)


ERRNO_CODES = {
    errno.ENOENT: "not-found",
    errno.ENOTDIR: "not-a-directory",
    errno.EISDIR: "is-a-directory",
    errno.ELOOP: "symlink",
    errno.EEXIST: "exists",
    errno.ENOTEMPTY: "not-empty",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EROFS: "permission",
    errno.ENOSPC: "no-space",
    errno.EDQUOT: "no-space",
    errno.EFBIG: "no-space",
    errno.ENAMETOOLONG: "bad-path",
}
REASONS = {
    "not-found": "does not exist",
    "not-a-directory": "is not a directory",
    "is-a-directory": "is a directory",
    "symlink": "is a symlink (not followed unless follow_symlinks is asked)",
    "exists": "exists already",
    "not-empty": "is a directory that is not empty",
    "permission": "permission denied",
    "no-space": "no space left on the device",
}


def refusal(exc: OSError, path: str) -> FileRefused:
    """An OSError about `path` as the refusal naming it and the reason."""
    code = ERRNO_CODES.get(exc.errno or 0, "io")
    reason = REASONS.get(code) or (exc.strerror or str(exc))
    return FileRefused(code, f"{path}: {reason}")


def split(path: str) -> list[str]:
    """The components of an absolute path ([] for `/`), or `bad-path`."""
    if not path or "\x00" in path:
        raise FileRefused("bad-path", "the path is empty or contains a NUL byte")
    if len(path) > MAX_PATH:
        raise FileRefused("bad-path", f"the path is longer than {MAX_PATH} characters")
    if not path.startswith("/"):
        raise FileRefused("bad-path", f"{path}: the path must be absolute")
    body = path[1:]
    if body.endswith("/"):
        body = body[:-1]
    if not body:
        return []
    parts = body.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise FileRefused("bad-path", f"{path}: empty, '.' or '..' components are not accepted")
        if len(part.encode()) > MAX_NAME:
            raise FileRefused("bad-path", f"{path}: a component is longer than {MAX_NAME} bytes")
    return parts


def join(parts: list[str]) -> str:
    return "/" + "/".join(parts)


@dataclass
class Located:
    """A path resolved to its directory: `dir_fd` (owned: close it) and the last `name`
    ("" for `/` itself, with `dir_fd` the root)."""

    dir_fd: int
    name: str
    path: str

    def close(self) -> None:
        os.close(self.dir_fd)

    def __enter__(self) -> Located:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lstat(self) -> os.stat_result | None:
        """The entry itself (a symlink is not followed), None when it does not exist."""
        try:
            if not self.name:
                return os.fstat(self.dir_fd)
            return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise refusal(exc, self.path) from None


def open_dir_at(dir_fd: int, name: str, where: str, *, follow: bool = False) -> int:
    """Open the directory `name` under `dir_fd` (never through a symlink unless `follow`)."""
    flags = DIR_FLAGS | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and not follow:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                raise refusal(exc, where) from None
            if stat.S_ISLNK(st.st_mode):
                raise FileRefused("symlink", f"{where}: {REASONS['symlink']}") from None
        raise refusal(exc, where) from None


def locate(
    path: str,
    *,
    follow: bool = False,
    parents: bool = False,
    mode: int = 0o755,
    owner: tuple[int, int] | None = None,
) -> Located:
    """Open `path`'s directory from `/` down, one component at a time; with `parents`, make
    the missing ones (`mode`, chowned to `owner` when given)."""
    parts = split(path)
    fd = os.open("/", DIR_FLAGS)
    try:
        for i, part in enumerate(parts[:-1]):
            where = join(parts[: i + 1])
            try:
                nfd = open_dir_at(fd, part, where, follow=follow)
            except FileRefused as exc:
                if not (parents and exc.code == "not-found"):
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as err:
                    raise refusal(err, where) from None
                nfd = open_dir_at(fd, part, where, follow=follow)
                if owner is not None:
                    try:
                        os.fchown(nfd, *owner)
                    except OSError as err:
                        os.close(nfd)
                        raise refusal(err, where) from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return Located(fd, parts[-1] if parts else "", join(parts))


def file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def ids_of(owner: str, group: str, default: tuple[int, int]) -> tuple[int, int]:
    """uid and gid of the names (a user's primary group when `group` is ""), or `bad-owner`."""
    uid, gid = default
    if owner:
        try:
            pw = pwd.getpwnam(owner)
        except KeyError:
            raise FileRefused("bad-owner", f"no such user {owner!r}", "owner") from None
        uid, gid = pw.pw_uid, pw.pw_gid
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise FileRefused("bad-owner", f"no such group {group!r}", "group") from None
    return uid, gid
