"""Files of an instance (`client.instances.files`): upload, download, list, stat, mkdir, remove
over `/api/v2/admin/instances/{id}/files`.

Transfers stream: an upload reads its source `CHUNK` bytes at a time (a local directory is
sent as a tar stream made as it goes), a download writes each chunk as it comes (to a
temporary name beside a local destination, renamed at the end; a directory arrives as a tar
stream, unpacked with `tarfile`'s `data` filter). An upload hashes what it sends and checks
the SHA-256 the server answers (`TransferFailed` when they differ); a download the server
checks against the agent's SHA-256, and breaks the response off when they differ (raised as
`TransferFailed`, and a local destination is left as it was). `progress(done, total)` is
called as bytes move (`total` None when unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tarfile
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Any

import aiohttp

from agentic_sandbox.sdk.errors import SandboxError, from_response
from agentic_sandbox.sdk.models import Download, FileInfo, FileList, Removed, Upload
from agentic_sandbox.sdk.operations import ADMIN, Resource
from agentic_sandbox.sdk.transport import clean_params

CHUNK = 1024 * 1024
Progress = Callable[[int, int | None], None]
Source = str | os.PathLike[str] | IO[bytes] | bytes
Dest = str | os.PathLike[str] | IO[bytes]
NO_READ_LIMIT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)


class TransferFailed(SandboxError):
    """A transfer ended but what arrived is not what was sent (a SHA-256 mismatch)."""


async def _file_chunks(
    f: IO[bytes], digest: Any, progress: Progress | None, total: int | None
) -> AsyncIterator[bytes]:
    done = 0
    while data := await asyncio.to_thread(f.read, CHUNK):
        digest.update(data)
        done += len(data)
        if progress is not None:
            progress(done, total)
        yield data


async def _tar_chunks(root: Path, digest: Any, progress: Progress | None) -> AsyncIterator[bytes]:
    """A tar stream of the directory `root`, made in a thread as it is sent (one chunk
    waiting at most: the thread blocks until the upload takes it)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(maxsize=2)
    stop = threading.Event()

    class Sink:
        def write(self, data: bytes) -> int:
            if stop.is_set():
                raise OSError("the upload stopped")
            asyncio.run_coroutine_threadsafe(queue.put(bytes(data)), loop).result()
            return len(data)

    def make() -> None:
        try:
            with tarfile.open(fileobj=Sink(), mode="w|", bufsize=CHUNK) as tar:  # type: ignore[call-overload,unused-ignore]
                tar.add(str(root), arcname=".")
            end: bytes | BaseException | None = None
        except BaseException as exc:  # handed to the reader
            end = exc
        if not stop.is_set():
            asyncio.run_coroutine_threadsafe(queue.put(end), loop).result()

    worker = loop.run_in_executor(None, make)
    done = 0
    try:
        while True:
            item = await queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise SandboxError(f"cannot read {root}: {item}")
            digest.update(item)
            done += len(item)
            if progress is not None:
                progress(done, None)
            yield item
    finally:
        stop.set()
        while not queue.empty():
            queue.get_nowait()
        with contextlib.suppress(Exception):
            await worker


class AsyncFiles(Resource):
    """Files of instances over their agent link."""

    def _path(self, instance_id: str) -> str:
        return f"{ADMIN}/instances/{instance_id}/files"

    async def stat(self, instance_id: str, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        """The path's type, size, mode, owner and mtime."""
        params = {"path": path, "follow_symlinks": follow_symlinks or None}
        return await self._t.model(
            FileInfo, "GET", self._path(instance_id) + "/stat", params=params
        )

    async def list(
        self,
        instance_id: str,
        path: str,
        *,
        follow_symlinks: bool = False,
        limit: int | None = None,
    ) -> FileList:
        """The directory's entries (`truncated` when there were more than listed)."""
        params = {"path": path, "follow_symlinks": follow_symlinks or None, "limit": limit}
        return await self._t.model(
            FileList, "GET", self._path(instance_id) + "/list", params=params
        )

    async def mkdir(
        self, instance_id: str, path: str, *, parents: bool = False, mode: int | None = None
    ) -> FileInfo:
        body: dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            body["mode"] = f"{mode:04o}"
        return await self._t.model(
            FileInfo, "POST", self._path(instance_id) + "/mkdir", json_body=body
        )

    async def remove(self, instance_id: str, path: str, *, recursive: bool = False) -> Removed:
        """A file, an empty directory, or (`recursive`) a tree; symlinks are never followed."""
        params = {"path": path, "recursive": recursive or None}
        return await self._t.model(Removed, "DELETE", self._path(instance_id), params=params)

    async def upload(
        self,
        instance_id: str,
        source: Source,
        remote: str,
        *,
        mode: int | None = None,
        owner: str | None = None,
        group: str | None = None,
        parents: bool = False,
        follow_symlinks: bool = False,
        progress: Progress | None = None,
    ) -> Upload:
        """Upload `source` (a local path — a directory goes as a tar stream and becomes the
        new directory `remote` —, a binary file object, or bytes) to `remote`. The guest
        keeps it only whole: written to a temporary name, SHA-256 checked, renamed."""
        digest = hashlib.sha256()
        params: dict[str, Any] = {
            "path": remote,
            "mode": f"{mode:04o}" if mode is not None else None,
            "owner": owner,
            "group": group,
            "parents": parents or None,
            "follow_symlinks": follow_symlinks or None,
        }
        headers = {**self._t.headers(), "Content-Type": "application/octet-stream"}
        opened: IO[bytes] | None = None
        body: Any
        try:
            if isinstance(source, bytes):
                digest.update(source)
                body = source
                if progress is not None:
                    progress(len(source), len(source))
            elif isinstance(source, str | os.PathLike):
                local = Path(source)
                if await asyncio.to_thread(local.is_dir):
                    headers["Content-Type"] = "application/x-tar"
                    body = _tar_chunks(local, digest, progress)
                else:
                    opened = await asyncio.to_thread(local.open, "rb")
                    size = os.fstat(opened.fileno()).st_size
                    headers["Content-Length"] = str(size)
                    body = _file_chunks(opened, digest, progress, size)
            else:
                body = _file_chunks(source, digest, progress, None)
            doc = await self._send("PUT", instance_id, params, headers, body)
        finally:
            if opened is not None:
                opened.close()
        out = Upload.model_validate(doc)
        if out.sha256 != digest.hexdigest():
            raise TransferFailed(
                f"{remote}: the server kept SHA-256 {out.sha256}, this side sent "
                f"{digest.hexdigest()}"
            )
        return out

    async def _send(
        self,
        method: str,
        instance_id: str,
        params: dict[str, Any],
        headers: dict[str, str],
        body: Any,
    ) -> Any:
        t = self._t
        await t.resolve_leader()  # a streamed body cannot be re-sent after a redirect
        try:
            async with t.session.request(
                method,
                t.url + self._path(instance_id),
                params=clean_params(params),
                headers=headers,
                data=body,
                timeout=NO_READ_LIMIT,
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise from_response(resp.status, raw, resp.headers.get("Retry-After"))
                return await resp.json(content_type=None) if raw else None
        except aiohttp.ClientError as exc:
            raise t._connection_failed(exc) from None

    async def chunks(
        self, instance_id: str, remote: str, *, follow_symlinks: bool = False
    ) -> AsyncIterator[bytes]:
        """The bytes of `remote` as they come (a directory: its tar stream)."""
        async for data in self._download(instance_id, remote, follow_symlinks, None, None):
            yield data

    async def _download(
        self,
        instance_id: str,
        remote: str,
        follow: bool,
        progress: Progress | None,
        meta: dict[str, str] | None,
    ) -> AsyncIterator[bytes]:
        t = self._t
        params = {"path": remote, "follow_symlinks": follow or None}
        await t.resolve_leader()
        try:
            async with t.session.get(
                t.url + self._path(instance_id),
                params=clean_params(params),
                headers=t.headers(),
                timeout=NO_READ_LIMIT,
            ) as resp:
                if resp.status >= 400:
                    raw = await resp.read()
                    raise from_response(resp.status, raw, resp.headers.get("Retry-After"))
                kind = resp.headers.get("X-File-Type", "file")
                if meta is not None:
                    meta["type"] = kind
                total = int(resp.headers.get("X-File-Size", "0")) if kind == "file" else None
                done = 0
                async for data in resp.content.iter_chunked(CHUNK):
                    done += len(data)
                    if progress is not None:
                        progress(done, total)
                    yield data
        except aiohttp.ClientPayloadError as exc:
            raise TransferFailed(f"{remote}: the download was broken off: {exc}") from None
        except aiohttp.ClientError as exc:
            raise t._connection_failed(exc) from None

    async def download(
        self,
        instance_id: str,
        remote: str,
        dest: Dest,
        *,
        follow_symlinks: bool = False,
        progress: Progress | None = None,
    ) -> Download:
        """Download `remote` into `dest`: a local path (a file is written to a temporary
        name beside it and renamed at the end; a directory is unpacked as the directory
        `dest`, which must not exist) or a binary file object (a directory: its tar stream)."""
        digest = hashlib.sha256()
        meta: dict[str, str] = {}
        size = 0
        chunks = self._download(instance_id, remote, follow_symlinks, progress, meta)
        if not isinstance(dest, str | os.PathLike):
            async for data in chunks:
                digest.update(data)
                size += len(data)
                await asyncio.to_thread(dest.write, data)
            return Download(remote, meta.get("type", "file"), size, digest.hexdigest())
        target = Path(dest)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                async for data in chunks:
                    digest.update(data)
                    size += len(data)
                    await asyncio.to_thread(f.write, data)
            if meta.get("type") == "directory":
                if await asyncio.to_thread(target.exists):
                    raise SandboxError(f"{target}: exists already (a directory is unpacked new)")
                await asyncio.to_thread(_unpack, Path(tmp), target)
            else:
                os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return Download(remote, meta.get("type", "file"), size, digest.hexdigest())


def _unpack(archive: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with tarfile.open(archive, mode="r:") as tar:
            tar.extractall(staging, filter="data")
        staging.rename(target)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
