"""Files over the agent link: one byte stream (`broker/agentlink/streams.py`) per operation.

An upload reads the request body as it comes (`request.content`, never the whole of it) and
writes it into the stream's channel 0 as the agent grants credit, hashing it; then the
SHA-256 goes on channel `DIGEST` and the agent — which hashed what it wrote — keeps the file
only if both agree (temporary name, fsync, rename: nothing partial is ever at the
destination). A caller's `sha256` is compared before the server sends its own: a body that
does not match it is never kept. A download writes each chunk to the HTTP response before the
next is read (credit goes back only as the response takes them: a slow client slows its own
transfer, nothing piles up), and checks the agent's SHA-256 at the end — a mismatch breaks the
response off instead of ending it cleanly.

Limits (problem+json naming them): `SANDBOX_FILES_MAX_UPLOAD_BYTES` (413, from the announced
length before anything is opened, else as soon as the body passes it) and
`SANDBOX_FILES_MAX_TRANSFERS_PER_INSTANCE` (429). The agent's refusals name the path and the
reason (`problem()`). Every operation that changes something, and every download, is
audited (`instance.files.*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from agentic_sandbox.broker.agentlink import (
    DIGEST,
    KIND_NAMES,
    AgentConnection,
    AgentRegistry,
    FileDownload,
    FileInfo,
    FileList,
    FileListing,
    FileMkdir,
    FileRemove,
    FileRemoved,
    FileResult,
    FileStat,
    FileUpload,
    LinkClosed,
    ServerStream,
    StreamError,
    StreamLost,
    TooManyStreams,
)
from agentic_sandbox.broker.files.models import FileInfoOut
from agentic_sandbox.broker.http.problems import ProblemError, not_ready, too_many
from agentic_sandbox.broker.services import Services

log = logging.getLogger(__name__)

ACCEPT_TIMEOUT = 30.0  # the agent answers an open at once; under TCG it can take a while
WINDOW = 4 * 1024 * 1024  # a download grants this per channel (bulk: fewer credit round trips)
FRAME = 256 * 1024  # an upload's frames, when the agent takes them (`ServerStream.max_frame`)
RESULT_TIMEOUT = 600.0  # after the last byte: fsync and rename of a big file on a slow disk
DATA_OUT = 1
#: the agent's refusal codes: HTTP status, problem code
AGENT_CODES: dict[str, tuple[int, str]] = {
    "bad-path": (422, "bad-path"),
    "not-found": (404, "path-not-found"),
    "not-a-directory": (409, "not-a-directory"),
    "is-a-directory": (409, "is-a-directory"),
    "exists": (409, "path-exists"),
    "not-empty": (409, "directory-not-empty"),
    "symlink": (422, "symlink-refused"),
    "permission": (403, "path-permission"),
    "no-space": (507, "no-space"),
    "bad-tar": (422, "bad-tar"),
    "bad-size": (400, "size-mismatch"),
    "digest-mismatch": (422, "digest-mismatch"),
    "bad-owner": (422, "bad-owner"),
    "too-many-streams": (429, "too-many-streams"),
    "unsupported": (501, "files-unsupported"),
}
FIELDS = {"path": "query.path", "owner": "query.owner", "group": "query.group", "body": "body"}


def problem(exc: StreamError, path: str) -> ProblemError:
    """An agent's refusal (or a lost stream) as the problem the caller gets: the path, the
    reason, the field."""
    if isinstance(exc, StreamLost):
        if exc.code == "timeout":
            return ProblemError(504, f"{path}: {exc.message}", code="agent-timeout")
        return ProblemError(502, f"{path}: {exc.message}; nothing was kept", code="agent-link-lost")
    status, code = AGENT_CODES.get(exc.code, (502, "agent-error"))
    detail = exc.message if path in exc.message else f"{path}: {exc.message}"
    field = FIELDS.get(exc.field or "path", "query.path")
    return ProblemError(
        status,
        detail,
        code=code,
        errors=[{"field": field, "message": exc.message, "type": exc.code}],
        extra={"path": path, "reason": exc.code},
        headers={"Retry-After": "5"} if status == 429 else None,
    )


def info_out(i: FileInfo) -> FileInfoOut:
    kind = i.type if i.type in ("file", "directory", "symlink") else "other"
    return FileInfoOut(
        path=i.path[:4096],
        name=i.name[:255],
        type=kind,
        size=i.size,
        mode=f"{i.mode & 0o7777:04o}",
        uid=i.uid,
        gid=i.gid,
        owner=i.owner[:64],
        group=i.group[:64],
        mtime=round(i.mtime_ns / 1e9, 6),
        link_target=i.link_target[:4096] or None,
    )


async def _why(stream: ServerStream, exc: StreamError) -> StreamError:
    """What ended a stream our write found closed: the agent's own error when it sent one
    (no space, a bad tar member…), else `exc`."""
    if exc.code != "closed":
        return exc
    try:
        async with asyncio.timeout(1.0):
            await stream.result()
    except StreamError as agent:
        return agent
    except TimeoutError:
        pass
    return exc


class Body(Protocol):
    """What an upload reads (an aiohttp request's `content`, or bytes in hand)."""

    async def readany(self) -> bytes: ...


@dataclass
class Target:
    """The instance a request acts on: its live agent link and who asks."""

    instance_id: str
    owner: str
    actor: str
    conn: AgentConnection


class FilesService:
    def __init__(self, svc: Services, registry: AgentRegistry) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.registry = registry
        self._transfers: dict[str, int] = {}

    # ---- before anything runs -------------------------------------------------------------------
    def target(self, *, instance_id: str, incarnation: str, owner: str, actor: str) -> Target:
        conn = self.registry.get(instance_id)
        if conn is None or not conn.ready or conn.incarnation != incarnation:
            raise not_ready(f"the agent of instance {instance_id!r} is not connected")
        if "file_upload" not in conn.info.stream_kinds:
            raise ProblemError(
                501,
                f"the agent of instance {instance_id!r} does not transfer files (agent version "
                f"{conn.info.agent_version or 'unknown'}; upgrade it)",
                code="files-unsupported",
            )
        return Target(instance_id, owner, actor, conn)

    @contextlib.contextmanager
    def slot(self, instance_id: str) -> Iterator[None]:
        """One of the instance's `SANDBOX_FILES_MAX_TRANSFERS_PER_INSTANCE` places (429)."""
        limit = self.settings.files_max_transfers_per_instance
        running = self._transfers.get(instance_id, 0)
        if running >= limit:
            raise ProblemError(
                429,
                f"instance {instance_id!r} has {running} file transfers running (the limit, "
                "SANDBOX_FILES_MAX_TRANSFERS_PER_INSTANCE)",
                code="too-many-transfers",
                headers={"Retry-After": "5"},
            )
        self._transfers[instance_id] = running + 1
        try:
            yield
        finally:
            left = self._transfers[instance_id] - 1
            if left:
                self._transfers[instance_id] = left
            else:
                del self._transfers[instance_id]

    def check_size(self, announced: int | None) -> None:
        limit = self.settings.files_max_upload_bytes
        if announced is not None and announced > limit:
            raise self._too_large(f"the body announces {announced} bytes")

    def _too_large(self, what: str) -> ProblemError:
        limit = self.settings.files_max_upload_bytes
        return ProblemError(
            413,
            f"{what}; an upload may have at most {limit} bytes (SANDBOX_FILES_MAX_UPLOAD_BYTES)",
            code="upload-too-large",
            errors=[{"field": "body", "message": "too large", "type": "too_large"}],
            extra={"limit": limit},
            close=True,
        )

    async def _open(
        self, t: Target, spec: Any, path: str, window: int = 0
    ) -> tuple[ServerStream, Any]:
        try:
            stream = t.conn.streams.open(spec, window=window)
        except TooManyStreams as exc:
            raise too_many(str(exc), 5) from None
        except (LinkClosed, StreamLost) as exc:
            raise not_ready(
                f"the agent of instance {t.instance_id!r} is not connected: {exc}"
            ) from None
        try:
            async with asyncio.timeout(ACCEPT_TIMEOUT):
                started = await stream.started()
        except StreamError as exc:
            raise problem(exc, path) from None
        except TimeoutError:
            stream.cancel("canceled", "the agent did not answer in time")
            raise ProblemError(
                504, f"{path}: the agent did not answer in time", code="agent-timeout"
            ) from None
        return stream, started

    async def _result(self, stream: ServerStream, path: str) -> Any:
        """The agent's result, within `RESULT_TIMEOUT` from now (one timer on the stream)."""
        stream.expire_at(
            asyncio.get_running_loop().time() + RESULT_TIMEOUT, "the agent did not finish in time"
        )
        try:
            return await stream.result()
        except StreamError as exc:
            raise problem(exc, path) from None

    async def _simple(self, t: Target, spec: Any, path: str) -> Any:
        stream, _ = await self._open(t, spec, path)
        try:
            return await self._result(stream, path)
        finally:
            stream.cancel("canceled", "the server stopped waiting")

    def _audit(self, t: Target, action: str, detail: dict[str, Any]) -> None:
        self.svc.audit.record(
            t.actor, f"instance.files.{action}", "instance", t.instance_id, detail=detail
        )

    # ---- the small ones -------------------------------------------------------------------------
    async def stat(self, t: Target, path: str, follow: bool) -> FileInfo:
        out = await self._simple(t, FileStat(path, follow), path)
        assert isinstance(out, FileInfo)
        return out

    async def list(self, t: Target, path: str, follow: bool, limit: int | None) -> FileListing:
        out = await self._simple(t, FileList(path, follow, limit or 0), path)
        assert isinstance(out, FileListing)
        return out

    async def mkdir(self, t: Target, spec: FileMkdir) -> FileInfo:
        out = await self._simple(t, spec, spec.path)
        assert isinstance(out, FileInfo)
        self._audit(t, "mkdir", {"path": spec.path[:4096]})
        return out

    async def remove(self, t: Target, path: str, recursive: bool) -> FileRemoved:
        out = await self._simple(t, FileRemove(path, recursive), path)
        assert isinstance(out, FileRemoved)
        self._audit(
            t, "remove", {"path": path[:4096], "recursive": recursive, "removed": out.removed}
        )
        return out

    # ---- upload ---------------------------------------------------------------------------------
    async def upload(
        self, t: Target, spec: FileUpload, body: Body, expected: str | None
    ) -> FileResult:
        """Stream `body` into the agent; the agent's result once it kept the file."""
        stream, _ = await self._open(t, spec, spec.path)
        limit = self.settings.files_max_upload_bytes
        digest = hashlib.sha256()
        total = 0
        done = False
        parts: list[bytes] = []  # what came since the last write: frames of `FRAME`, not of
        pending = 0  # whatever size the body's reads happen to have
        try:
            while True:
                data = await body.readany()
                if data:
                    total += len(data)
                    if total > limit:
                        raise self._too_large(f"the body passed {limit} bytes")
                    digest.update(data)
                    parts.append(data)
                    pending += len(data)
                if pending >= FRAME or (pending and not data):
                    await stream.write(
                        0, parts[0] if len(parts) == 1 else b"".join(parts), chunk=FRAME
                    )
                    parts.clear()
                    pending = 0
                if not data:
                    break
            await stream.end(0)
            ours = digest.digest()
            if expected is not None and ours.hex() != expected.lower():
                raise ProblemError(
                    422,
                    f"{spec.path}: the body's SHA-256 is {ours.hex()}, not the {expected} "
                    "given; nothing was kept",
                    code="digest-mismatch",
                    errors=[
                        {
                            "field": "query.sha256",
                            "message": "does not match the body",
                            "type": "digest-mismatch",
                        }
                    ],
                )
            await stream.write(DIGEST, ours)
            await stream.end(DIGEST)
            result = await self._result(stream, spec.path)
            assert isinstance(result, FileResult)
            if result.sha256 != ours or result.size != total:
                raise ProblemError(
                    502,
                    f"{spec.path}: the agent kept something other than was sent",
                    code="agent-error",
                )
            done = True
        except StreamError as exc:
            raise problem(await _why(stream, exc), spec.path) from None
        finally:
            if not done:
                stream.cancel("canceled", "the upload did not finish")
        self._audit(
            t,
            "upload",
            {
                "path": spec.path[:4096],
                "size": total,
                "sha256": ours.hex(),
                "directory": spec.directory,
            },
        )
        log.info(
            "upload of %d bytes to %s on %s",
            total,
            spec.path,
            t.instance_id,
            extra={"instance_id": t.instance_id},
        )
        return result

    # ---- download -------------------------------------------------------------------------------
    async def open_download(
        self, t: Target, path: str, follow: bool
    ) -> tuple[ServerStream, FileInfo]:
        stream, info = await self._open(t, FileDownload(path, follow), path, WINDOW)
        if not isinstance(info, FileInfo):
            stream.cancel("protocol", "a download accept without its info")
            raise ProblemError(502, f"{path}: the agent sent no file info", code="agent-error")
        return stream, info

    async def chunks(
        self, t: Target, stream: ServerStream, path: str
    ) -> AsyncGenerator[bytes, None]:
        """The download's bytes as they come; raises `ProblemError` if the stream fails or
        the agent's digest does not match what came."""
        digest = hashlib.sha256()
        total = 0
        done = False
        try:
            while (chunk := await stream.read()) is not None:
                if chunk.channel != DATA_OUT or not chunk.data:
                    continue
                digest.update(chunk.data)
                total += len(chunk.data)
                yield chunk.data
            result = await self._result(stream, path)
            assert isinstance(result, FileResult)
            if result.sha256 != digest.digest() or result.size != total:
                raise ProblemError(
                    502,
                    f"{path}: the download's SHA-256 does not match the agent's",
                    code="digest-mismatch",
                )
            done = True
        except StreamError as exc:
            raise problem(exc, path) from None
        finally:
            if not done:
                stream.cancel("canceled", "the download did not finish")
        self._audit(
            t, "download", {"path": path[:4096], "size": total, "sha256": digest.hexdigest()}
        )


__all__ = ["KIND_NAMES", "FilesService", "Target", "info_out", "problem"]
