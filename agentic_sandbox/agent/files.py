"""Files: upload, download, stat, list, mkdir and remove, one stream each (kinds `file_*`).

The opener runs on the event loop and does only what is quick and decides the answer's
headers: the path is checked and resolved (`paths.py`: component by component, `O_NOFOLLOW`),
an upload's temporary file is created, a download's file or directory opened and stat'ed.
What takes time — the bytes, a tar stream, a listing, a recursive remove — runs in a worker
thread of its own, bridged to the stream (`Bridge`): what arrives on channel 0 waits in a
queue bounded by the window the stream granted (credit goes back as the worker writes it);
what the worker sends waits for the server's credit. Nothing holds a whole file: a transfer
moves at most `BATCH` bytes at a time.

- **Upload** (`file_upload`): channel 0 is written to `.<name>.<random>.part` beside the
  destination (created `O_EXCL | O_NOFOLLOW`, 0600), hashing what is written; after channel
  0's end, channel `DIGEST` carries the sender's SHA-256, which must equal ours; then mode and
  owner (the replaced file's when not asked, else 0644 and the default user), fsync, rename
  over the destination, fsync of the directory. A directory (`directory`) is a tar stream
  unpacked into a temporary directory beside the destination (which must not exist), renamed
  into place at the end. A cancel, a lost link, a digest or size mismatch, any error: the
  temporary file or directory is removed — nothing partial is ever at the destination.
- **Download** (`file_download`): channel 1 carries the file, or a tar stream of the
  directory (symlinks inside stored as symlinks, never followed); the close carries the
  SHA-256 of what was sent.
- **stat / list / mkdir / remove**: the close carries the `FileInfo`, the `FileListing`
  (at most `LIST_LIMIT` entries, `truncated` past it), the new directory's `FileInfo`, or
  `FileRemoved`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import secrets
import shutil
import stat
import tarfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from agentic_sandbox.agent import tarstream
from agentic_sandbox.agent.paths import (
    DIR_FLAGS,
    FileRefused,
    Located,
    file_type,
    group_name,
    ids_of,
    locate,
    open_dir_at,
    refusal,
    user_name,
)
from agentic_sandbox.agent.streams import Stream
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

DATA_IN, DATA_OUT, DIGEST = 0, 1, 3
BATCH = 1024 * 1024  # what the worker reads or writes at once
WINDOW = 4 * 1024 * 1024  # what an upload grants per channel: bulk, fewer credit round trips
#: a transfer's frames, when the server takes them (`Stream.max_frame`): each frame costs a
#: message through gRPC on both sides, so larger ones cost less CPU per byte; a keystroke
#: waits behind at most one (a quarter of a millisecond on loopback)
FRAME = 256 * 1024
LIST_LIMIT = 10_000
EXIT_LIST_LIMIT = 128  # a session's exit listing (proto: `SessionExit.listing`)
KINDS = ("file_upload", "file_download", "file_stat", "file_list", "file_mkdir", "file_remove")


class Canceled(Exception):
    pass


@dataclass(frozen=True)
class FilesContext:
    default_user: str = ""

    @property
    def root(self) -> bool:
        return os.geteuid() == 0

    def default_ids(self) -> tuple[int, int]:
        if self.root and self.default_user:
            return ids_of(self.default_user, "", (os.getuid(), os.getgid()))
        return os.getuid(), os.getgid()

    def asked_ids(self, owner: str, group: str, fallback: tuple[int, int]) -> tuple[int, int]:
        ids = ids_of(owner, group, fallback)
        if ids != fallback and not self.root and ids != (os.getuid(), os.getgid()):
            raise FileRefused(
                "bad-owner", "the agent does not run as root: it cannot give files away", "owner"
            )
        return ids


def info_of(
    path: str,
    name: str,
    st: os.stat_result,
    link: str = "",
    names: dict[tuple[str, int], str] | None = None,
) -> pb.FileInfo:
    """`names`: a cache of owner and group names for one listing (entries mostly share them,
    and each lookup may be a file read)."""
    if names is None:
        owner, group = user_name(st.st_uid), group_name(st.st_gid)
    else:
        if ("u", st.st_uid) not in names:
            names["u", st.st_uid] = user_name(st.st_uid)
        if ("g", st.st_gid) not in names:
            names["g", st.st_gid] = group_name(st.st_gid)
        owner, group = names["u", st.st_uid], names["g", st.st_gid]
    return pb.FileInfo(
        path=path,
        name=name,
        type=file_type(st.st_mode),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        owner=owner,
        group=group,
        mtime_ns=st.st_mtime_ns,
        link_target=link,
    )


# ---- the bridge between the loop and a worker thread ------------------------------------------
class Bridge:
    """A stream's handler whose work runs in a thread: `recv`/`send`/`finish` for the worker."""

    def __init__(self, stream: Stream, loop: asyncio.AbstractEventLoop) -> None:
        self.stream = stream
        self.loop = loop
        self._cond = threading.Condition()
        self._inbox: deque[tuple[int, bytes, bool]] = deque()
        self._eof: set[int] = set()
        self._credit = asyncio.Event()
        self.canceled = False
        self.detached = False  # the link is gone: nothing is sent
        self._owed: dict[int, int] = {}
        self.cleanup: Callable[[], None] | None = None

    # loop side (StreamHandler)
    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        with self._cond:
            self._inbox.append((channel, data, eof))
            self._cond.notify()

    def on_credit(self, channel: int) -> None:
        self._credit.set()

    def on_close(self, error: pb.StreamError | None) -> None:
        if error is not None and error.code == "link-lost":
            self.detached = True
        with self._cond:
            self.canceled = True
            self._cond.notify_all()
        self._credit.set()

    # worker side
    def is_canceled(self) -> bool:
        return self.canceled

    def recv(self, channel: int, limit: int = BATCH) -> tuple[bytes, bool]:
        """What arrived on `channel` (up to about `limit`), and whether it has ended; waits
        for something. Frames of other channels are kept for later."""
        parts: list[bytes] = []
        size = 0
        eof = False
        with self._cond:
            while True:
                if self.canceled:
                    raise Canceled()
                keep: deque[tuple[int, bytes, bool]] = deque()
                while self._inbox and size < limit and not eof:
                    ch, data, end = self._inbox.popleft()
                    if ch != channel:
                        keep.append((ch, data, end))
                        continue
                    if data:
                        parts.append(data)
                        size += len(data)
                    eof = end
                self._inbox.extendleft(reversed(keep))
                if parts or eof:
                    break
                self._cond.wait()
        if size:
            self.loop.call_soon_threadsafe(self.stream.consumed, channel, size)
        return b"".join(parts) if len(parts) != 1 else parts[0], eof

    def send(self, channel: int, data: bytes) -> None:
        """Send `data` as the server's credit allows (blocks until it is queued)."""
        if data:
            asyncio.run_coroutine_threadsafe(self._send(channel, data), self.loop).result()

    async def _send(self, channel: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.canceled:
                raise Canceled()
            room = self.stream.room(channel)
            if room <= 0:
                self._credit.clear()
                await self._credit.wait()
                continue
            n = min(room, FRAME, self.stream.max_frame, len(view))
            self.stream.send(channel, data if n == len(data) else bytes(view[:n]))
            view = view[n:]

    def end(self, channel: int) -> None:
        self.loop.call_soon_threadsafe(self.stream.send, channel, b"", True)

    def finish(self, close: pb.StreamClose) -> None:
        if not self.detached:
            self.loop.call_soon_threadsafe(self.stream.finish, close)

    def run(self, name: str, work: Callable[[], pb.StreamClose]) -> None:
        """Run `work` in a thread; its close (or its error's) ends the stream."""

        def main() -> None:
            try:
                close = work()
            except Canceled:
                close = pb.StreamClose(error=pb.StreamError(code="canceled", message="cancelled"))
            except FileRefused as exc:
                close = pb.StreamClose(error=exc.error())
            except Exception as exc:
                log.exception("file stream %d failed", self.stream.id)
                close = pb.StreamClose(
                    error=pb.StreamError(code="internal", message=f"{type(exc).__name__}: {exc}")
                )
            finally:
                if self.cleanup is not None:
                    try:
                        self.cleanup()
                    except Exception:
                        log.exception("file stream %d: cleaning up failed", self.stream.id)
            self.finish(close)

        threading.Thread(target=main, name=f"{name}-{self.stream.id}", daemon=True).start()


class _Reader:
    """Channel 0 as a blocking file (for `tarfile`), hashing what it hands out."""

    def __init__(self, bridge: Bridge, digest: hashlib._Hash, limit: int) -> None:
        self.bridge = bridge
        self.digest = digest
        self.buf = b""
        self.eof = False
        self.total = 0
        self.limit = limit

    def read(self, n: int = -1) -> bytes:
        while not self.eof and (n < 0 or len(self.buf) < n):
            data, self.eof = self.bridge.recv(DATA_IN)
            self.total += len(data)
            if self.limit and self.total > self.limit:
                raise FileRefused("bad-size", f"more than the announced {self.limit} bytes", "body")
            self.digest.update(data)
            self.buf += data
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def drain(self) -> None:
        while self.read(BATCH):
            pass


class _Writer:
    """Channel 1 as a blocking file (for `tarfile`), hashing what it sends."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.digest = hashlib.sha256()
        self.total = 0

    def write(self, data: bytes) -> int:
        if self.bridge.is_canceled():
            raise Canceled()
        self.digest.update(data)
        self.total += len(data)
        self.bridge.send(DATA_OUT, bytes(data))
        return len(data)

    def flush(self) -> None:
        return None


def _digest_from(bridge: Bridge) -> bytes:
    got = b""
    eof = False
    while not eof:
        data, eof = bridge.recv(DIGEST, 64)
        got += data
        if len(got) > 64:
            break
    return got


def _temp_name(name: str) -> str:
    return f".{name[:200]}.{secrets.token_hex(6)}.part"


# ---- the kinds ------------------------------------------------------------------------------
def open_file_stream(
    ctx: FilesContext, stream: Stream, msg: pb.StreamOpen
) -> tuple[Bridge, pb.StreamAccept]:
    kind = msg.WhichOneof("kind")
    loop = asyncio.get_running_loop()
    bridge = Bridge(stream, loop)
    if kind == "file_upload":
        stream.window = WINDOW
        return bridge, _upload(ctx, bridge, msg.file_upload)
    if kind == "file_download":
        return bridge, _download(bridge, msg.file_download)
    if kind == "file_stat":
        spec = msg.file_stat
        bridge.run(
            "stat", lambda: pb.StreamClose(file_stat=stat_path(spec.path, spec.follow_symlinks))
        )
    elif kind == "file_list":
        spec_l = msg.file_list
        bridge.run("list", lambda: pb.StreamClose(file_list=list_path(spec_l)))
    elif kind == "file_mkdir":
        spec_m = msg.file_mkdir
        bridge.run("mkdir", lambda: pb.StreamClose(file_mkdir=make_dir(ctx, spec_m)))
    elif kind == "file_remove":
        spec_r = msg.file_remove
        bridge.run("remove", lambda: pb.StreamClose(file_remove=remove_path(spec_r)))
    else:
        raise FileRefused("unsupported", f"no {kind} streams", "")
    return bridge, pb.StreamAccept()


def stat_path(path: str, follow: bool) -> pb.FileInfo:
    with locate(path, follow=follow) as loc:
        st = loc.lstat()
        if st is None:
            raise FileRefused("not-found", f"{loc.path}: does not exist")
        link = ""
        if stat.S_ISLNK(st.st_mode):
            try:
                link = os.readlink(loc.name, dir_fd=loc.dir_fd)
            except OSError as exc:
                raise refusal(exc, loc.path) from None
            if follow:
                try:
                    st = os.stat(loc.name, dir_fd=loc.dir_fd)
                except OSError as exc:
                    raise refusal(exc, loc.path) from None
        return info_of(loc.path, loc.name or "/", st, link)


def _open_target_dir(loc: Located, follow: bool) -> int:
    if not loc.name:
        return os.dup(loc.dir_fd)
    return open_dir_at(loc.dir_fd, loc.name, loc.path, follow=follow)


def list_path(spec: pb.FileList) -> pb.FileListing:
    limit = min(spec.limit or LIST_LIMIT, LIST_LIMIT)
    with locate(spec.path, follow=spec.follow_symlinks) as loc:
        fd = _open_target_dir(loc, spec.follow_symlinks)
    try:
        out = pb.FileListing()
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in entries)
        if len(names) > limit:
            names, out.truncated = names[:limit], True
        base = loc.path.rstrip("/")
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                link = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
            except OSError:
                continue  # gone since the listing
            out.entries.append(info_of(f"{base}/{name}", name, st, link))
        return out
    except OSError as exc:
        raise refusal(exc, loc.path) from None
    finally:
        os.close(fd)


def exit_listing(path: str, limit: int = EXIT_LIST_LIMIT) -> pb.FileListing | None:
    """`path` listed as `list_path` lists it (symlinks not followed), for a session's exit
    (`OpenSession.list_on_exit`): on the loop, so the scan stops past `limit` names and a
    directory with more, or one that cannot be listed, is None (the server lists it with a
    stream instead, in the stream's thread, and names any error)."""
    try:
        with locate(path) as loc:
            fd = _open_target_dir(loc, False)
    except (FileRefused, OSError):
        return None
    try:
        with os.scandir(fd) as entries:
            names = [e.name for e in itertools.islice(entries, limit + 1)]
        if len(names) > limit:
            return None
        out = pb.FileListing()
        base = loc.path.rstrip("/")
        known: dict[tuple[str, int], str] = {}
        for name in sorted(names):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                link = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
            except OSError:
                continue  # gone since the listing
            out.entries.append(info_of(f"{base}/{name}", name, st, link, known))
        return out
    except OSError:
        return None
    finally:
        os.close(fd)


def make_dir(ctx: FilesContext, spec: pb.FileMkdir) -> pb.FileInfo:
    ids = ctx.asked_ids(spec.owner, spec.group, ctx.default_ids())
    give = ids != (os.getuid(), os.getgid())
    mode = spec.mode & 0o7777 if spec.has_mode else 0o755
    with locate(spec.path, parents=spec.parents, owner=ids if give else None) as loc:
        if not loc.name:
            raise FileRefused("exists", "/: exists already")
        try:
            os.mkdir(loc.name, mode, dir_fd=loc.dir_fd)
        except FileExistsError:
            st = loc.lstat()
            if spec.parents and st is not None and stat.S_ISDIR(st.st_mode):
                return info_of(loc.path, loc.name, st)
            raise FileRefused("exists", f"{loc.path}: exists already") from None
        except OSError as exc:
            raise refusal(exc, loc.path) from None
        fd = open_dir_at(loc.dir_fd, loc.name, loc.path)
        try:
            os.fchmod(fd, mode)  # not the umask's
            if give:
                os.fchown(fd, *ids)
            return info_of(loc.path, loc.name, os.fstat(fd))
        except OSError as exc:
            raise refusal(exc, loc.path) from None
        finally:
            os.close(fd)


def remove_path(spec: pb.FileRemove) -> pb.FileRemoved:
    with locate(spec.path) as loc:
        if not loc.name:
            raise FileRefused("permission", "/: the root cannot be removed")
        st = loc.lstat()
        if st is None:
            raise FileRefused("not-found", f"{loc.path}: does not exist")
        try:
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(loc.name, dir_fd=loc.dir_fd)
                return pb.FileRemoved(path=loc.path, removed=1)
            if not spec.recursive:
                os.rmdir(loc.name, dir_fd=loc.dir_fd)
                return pb.FileRemoved(path=loc.path, removed=1)
            count = _count(loc.dir_fd, loc.name)
            shutil.rmtree(loc.name, dir_fd=loc.dir_fd)  # fd-based: never follows a symlink
            return pb.FileRemoved(path=loc.path, removed=count)
        except OSError as exc:
            raise refusal(exc, loc.path) from None


def _count(dir_fd: int, name: str) -> int:
    fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        n = 1
        with os.scandir(fd) as entries:
            for e in entries:
                n += _count(fd, e.name) if e.is_dir(follow_symlinks=False) else 1
        return n
    finally:
        os.close(fd)


# ---- upload -----------------------------------------------------------------------------------
def _upload(ctx: FilesContext, bridge: Bridge, spec: pb.FileUpload) -> pb.StreamAccept:
    default = ctx.default_ids()
    asked = bool(spec.owner or spec.group)
    ids = ctx.asked_ids(spec.owner, spec.group, default) if asked else default
    give = ids != (os.getuid(), os.getgid())
    loc = locate(
        spec.path, follow=spec.follow_symlinks, parents=spec.parents, owner=ids if give else None
    )
    try:
        if not loc.name:
            raise FileRefused("is-a-directory", "/: is a directory")
        st = loc.lstat()
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise FileRefused("symlink", f"{loc.path}: is a symlink (it is not replaced)")
        if spec.directory:
            if st is not None:
                raise FileRefused("exists", f"{loc.path}: exists already")
            return _upload_dir(ctx, bridge, spec, loc, ids if (give or ctx.root) else None)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise FileRefused("is-a-directory", f"{loc.path}: is a directory")
        mode = spec.mode & 0o7777 if spec.has_mode else 0o644
        if st is not None:  # the replaced file's mode and owner, unless asked
            if not spec.has_mode:
                mode = stat.S_IMODE(st.st_mode)
            if not asked:
                ids = (st.st_uid, st.st_gid)
        tmp = _temp_name(loc.name)
        try:
            fd = os.open(tmp, tarstream.FILE_FLAGS, 0o600, dir_fd=loc.dir_fd)
        except OSError as exc:
            raise refusal(exc, loc.path) from None
    except BaseException:
        loc.close()
        raise

    done = False

    def cleanup() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=loc.dir_fd)
        loc.close()

    def work() -> pb.StreamClose:
        nonlocal done
        digest = hashlib.sha256()
        total = 0
        eof = False
        try:
            while not eof:
                data, eof = bridge.recv(DATA_IN)
                total += len(data)
                if spec.size and total > spec.size:
                    raise FileRefused(
                        "bad-size", f"more than the announced {spec.size} bytes", "body"
                    )
                digest.update(data)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            if spec.size and total != spec.size:
                raise FileRefused("bad-size", f"{total} bytes, {spec.size} announced", "body")
            theirs = _digest_from(bridge)
            ours = digest.digest()
            if theirs != ours:
                raise FileRefused(
                    "digest-mismatch",
                    f"{loc.path}: SHA-256 of what was written ({ours.hex()}) is not the "
                    f"sender's ({theirs.hex() or 'none'}); nothing was kept",
                    "body",
                )
            os.fchmod(fd, mode)
            if ids != (os.fstat(fd).st_uid, os.fstat(fd).st_gid):
                os.fchown(fd, *ids)
            os.fsync(fd)
            os.rename(tmp, loc.name, src_dir_fd=loc.dir_fd, dst_dir_fd=loc.dir_fd)
            done = True
            os.fsync(loc.dir_fd)
        except OSError as exc:
            raise refusal(exc, loc.path) from None
        log.info("uploaded %s (%d bytes)", loc.path, total, extra={"stream_id": bridge.stream.id})
        return pb.StreamClose(file_upload=pb.FileResult(path=loc.path, size=total, sha256=ours))

    bridge.cleanup = cleanup
    bridge.run("upload", work)
    return pb.StreamAccept()


def _upload_dir(
    ctx: FilesContext,
    bridge: Bridge,
    spec: pb.FileUpload,
    loc: Located,
    ids: tuple[int, int] | None,
) -> pb.StreamAccept:
    tmp = _temp_name(loc.name)
    try:
        os.mkdir(tmp, 0o700, dir_fd=loc.dir_fd)
        root_fd = open_dir_at(loc.dir_fd, tmp, loc.path)
    except OSError as exc:
        raise refusal(exc, loc.path) from None
    done = False
    asked = bool(spec.owner or spec.group)

    def chown(m: tarfile.TarInfo) -> tuple[int, int] | None:
        if ids is None:
            return None
        if asked or not ctx.root:
            return ids
        try:
            return ids_of(m.uname, m.gname, ids)
        except FileRefused:
            return ids

    def cleanup() -> None:
        with contextlib.suppress(OSError):
            os.close(root_fd)
        if not done:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp, dir_fd=loc.dir_fd)
        loc.close()

    def work() -> pb.StreamClose:
        nonlocal done
        digest = hashlib.sha256()
        reader = _Reader(bridge, digest, spec.size)
        count = tarstream.extract(
            reader,  # type: ignore[arg-type]
            root_fd,
            chown=chown,
            canceled=bridge.is_canceled,
            where=loc.path,
        )
        reader.drain()  # the end blocks, hashed as sent
        theirs = _digest_from(bridge)
        ours = digest.digest()
        if theirs != ours:
            raise FileRefused(
                "digest-mismatch",
                f"{loc.path}: SHA-256 of the tar stream ({ours.hex()}) is not the sender's "
                f"({theirs.hex() or 'none'}); nothing was kept",
                "body",
            )
        try:
            os.fsync(root_fd)
            os.rename(tmp, loc.name, src_dir_fd=loc.dir_fd, dst_dir_fd=loc.dir_fd)
            done = True
            os.fsync(loc.dir_fd)
        except OSError as exc:
            raise refusal(exc, loc.path) from None
        return pb.StreamClose(
            file_upload=pb.FileResult(path=loc.path, size=reader.total, sha256=ours, entries=count)
        )

    bridge.cleanup = cleanup
    bridge.run("upload-dir", work)
    return pb.StreamAccept()


# ---- download ---------------------------------------------------------------------------------
def _download(bridge: Bridge, spec: pb.FileDownload) -> pb.StreamAccept:
    follow = spec.follow_symlinks
    with locate(spec.path, follow=follow) as loc:
        if not loc.name:
            fd = os.dup(loc.dir_fd)
        else:
            try:
                fd = os.open(
                    loc.name,
                    os.O_RDONLY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW),
                    dir_fd=loc.dir_fd,
                )
            except OSError as exc:
                st = loc.lstat()
                if st is not None and stat.S_ISLNK(st.st_mode):
                    raise FileRefused(
                        "symlink", f"{loc.path}: is a symlink (not followed)"
                    ) from None
                raise refusal(exc, loc.path) from None
        path, name = loc.path, loc.name or "/"
    try:
        st = os.fstat(fd)
        info = info_of(path, name, st)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise FileRefused("bad-path", f"{path}: neither a file nor a directory")
    except BaseException:
        os.close(fd)
        raise
    directory = stat.S_ISDIR(st.st_mode)

    def cleanup() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    def work() -> pb.StreamClose:
        out = _Writer(bridge)
        entries = 0
        if directory:
            entries = tarstream.pack(
                fd,
                out,  # type: ignore[arg-type]
                canceled=bridge.is_canceled,
                where=path,
            )
        else:
            try:
                while data := os.read(fd, BATCH):
                    out.write(data)
            except OSError as exc:
                raise refusal(exc, path) from None
        bridge.end(DATA_OUT)
        return pb.StreamClose(
            file_download=pb.FileResult(
                path=path, size=out.total, sha256=out.digest.digest(), entries=entries
            )
        )

    bridge.cleanup = cleanup
    bridge.run("download", work)
    return pb.StreamAccept(file_download=info)


__all__ = ["KINDS", "FilesContext", "open_file_stream"]
