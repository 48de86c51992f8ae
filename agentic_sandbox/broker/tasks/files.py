"""A2A file parts: a message's files go into the task's working directory before the run, and
what the run leaves in its outbox comes back as artifacts with file parts.

- **Where**: every run of an instance whose agent transfers files gets a working directory
  `<SANDBOX_TASK_FILES_ROOT>/<task id>` (default root `/tmp/a2a-tasks`) with an `outbox`
  directory in it, made (owned by the run's user) before the run starts. The run's working
  directory is that directory unless the task runner names a `cwd`; `A2A_WORKDIR` and
  `A2A_OUTBOX` are in its environment either way.
- **In**: a `raw` part (base64 bytes) is written there under its `filename` (default
  `file-<part index>`) through the files path over the agent link (streamed in chunks, SHA-256
  checked, temporary name then rename), before the run. A name is relative, without `..`,
  empty components or NUL, at most 255 bytes a component and 8 deep (`outbox` excluded); a part
  is at most `SANDBOX_TASK_FILE_MAX_BYTES` decoded (default 8 MiB), a message carries at most
  `MAX_FILES`. A `url` part is refused: the server would fetch it on the instance's behalf,
  outside the instance's egress rules — send the bytes instead.
- **Out**: after the run, every regular file directly in the outbox (at most `MAX_OUTBOX`, by
  name) becomes an artifact `outbox/<name>` with one file part: its bytes (`raw`) when it is at
  most `SANDBOX_TASK_FILE_INLINE_BYTES` (default 256 KiB), else a `url` to download it from the
  admin files surface (`GET <public url>/api/v2/admin/instances/{id}/files?path=…`, with an
  operator token or the dashboard cookie, like every file download). The directory stays (a
  large file is downloaded from it) until the instance goes.

The transfers go through `TaskFiles` (implemented by the files component over its service,
`broker/files/tasks.py`, wired in `broker/components.py`): the task layer never builds stream
frames itself.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from agentic_sandbox.broker.agentlink import FileInfo
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.tasks.errors import InvalidTaskInput, UnsupportedContent

MAX_FILES = 32
MAX_OUTBOX = 100
MAX_DEPTH = 8
OUTBOX = "outbox"
OUTBOX_ARTIFACT_PREFIX = "outbox/"


class TaskFileError(Exception):
    """A transfer for a task failed (the reason names the path)."""


class TaskFiles(Protocol):
    """What the task layer asks of the files path; a refusal is a `ProblemError` naming the
    path and the reason (the files service's own)."""

    def available(self, instance_id: str) -> bool:
        """The instance's agent is connected and transfers files."""
        ...

    def session_dirs(self, instance_id: str) -> bool:
        """The instance's agent makes a session's directories as it opens it (a task's
        working directory and outbox without a `mkdir` of their own)."""
        ...

    async def mkdir(self, instance_id: str, owner: str, path: str, user: str) -> None:
        """`path` and its missing parents, owned by `user` ("" the agent's default)."""
        ...

    async def put(self, instance_id: str, owner: str, path: str, data: bytes, user: str) -> None:
        """Write `data` (streamed in chunks, checked, renamed into place) as `path`."""
        ...

    async def listing(self, instance_id: str, owner: str, path: str) -> list[FileInfo]:
        """The directory's entries ([] when it does not exist)."""
        ...

    async def read(self, instance_id: str, owner: str, path: str, limit: int) -> bytes:
        """The file's bytes (at most `limit`; a larger one is refused)."""
        ...


@dataclass(frozen=True)
class InFile:
    name: str  # relative to the task's working directory
    data: bytes
    media_type: str = ""


def _b64(value: str) -> bytes:
    std = value.replace("-", "+").replace("_", "/")
    return base64.b64decode(std + "=" * (-len(std) % 4), validate=True)


def check_name(name: str, where: str) -> str:
    """A file part's name, as a path relative to the working directory."""
    bad = ""
    parts = name.split("/")
    if not name:
        bad = "must not be empty"
    elif "\x00" in name:
        bad = "must not contain NUL bytes"
    elif name.startswith("/"):
        bad = "must be relative to the task's working directory, not absolute"
    elif any(p in ("", ".", "..") for p in parts):
        bad = "must not contain '..', '.' or empty components"
    elif len(parts) > MAX_DEPTH:
        bad = f"at most {MAX_DEPTH} components deep"
    elif any(len(p.encode()) > 255 for p in parts):
        bad = "a component is at most 255 bytes"
    elif parts[0] == OUTBOX:
        bad = "must not be in the outbox (that is for the run's own files)"
    if bad:
        raise InvalidTaskInput(f"{where}: the file name {name[:200]!r} {bad}", field=where)
    return name


def file_part(part: dict[str, Any], index: int, max_bytes: int) -> InFile:
    """An incoming file part (raw bytes), checked; a `url` part is refused."""
    where = f"message.parts[{index}]"
    if "url" in part:
        raise UnsupportedContent(
            "file parts by URL are not fetched: the server would fetch them on the instance's "
            "behalf, outside its egress rules; send the file's bytes as a raw part",
            field=f"{where}.url",
        )
    raw = part.get("raw")
    if not isinstance(raw, str):
        raise InvalidTaskInput("raw must be base64 text", field=f"{where}.raw")
    if len(raw) * 3 // 4 > max_bytes + 3:
        raise _too_large(where, max_bytes)
    try:
        data = _b64(raw)
    except (binascii.Error, ValueError):
        raise InvalidTaskInput("raw must be base64", field=f"{where}.raw") from None
    if len(data) > max_bytes:
        raise _too_large(where, max_bytes)
    name = part.get("filename") or f"file-{index}"
    if not isinstance(name, str):
        raise InvalidTaskInput("filename must be text", field=f"{where}.filename")
    media = part.get("mediaType") or ""
    return InFile(
        check_name(name, f"{where}.filename"), data, media if isinstance(media, str) else ""
    )


def _too_large(where: str, max_bytes: int) -> InvalidTaskInput:
    return InvalidTaskInput(
        f"{where}.raw: a file part is at most {max_bytes} bytes (SANDBOX_TASK_FILE_MAX_BYTES)",
        field=f"{where}.raw",
    )


def check_files(files: list[InFile]) -> None:
    if len(files) > MAX_FILES:
        raise InvalidTaskInput(
            f"at most {MAX_FILES} file parts in one message", field="message.parts"
        )
    seen: set[str] = set()
    for f in files:
        if f.name in seen:
            raise InvalidTaskInput(f"two file parts named {f.name!r}", field="message.parts")
        seen.add(f.name)


@dataclass(frozen=True)
class WorkDir:
    path: str
    outbox: str

    @classmethod
    def of(cls, root: str, task_id: str) -> WorkDir:
        path = posixpath.join(root, task_id)
        return cls(path, posixpath.join(path, OUTBOX))

    def env(self) -> dict[str, str]:
        return {"A2A_WORKDIR": self.path, "A2A_OUTBOX": self.outbox}


def _media_type(name: str) -> str:
    guessed, _ = mimetypes.guess_type(name)
    return guessed or "application/octet-stream"


async def outbox_artifacts(
    files: TaskFiles,
    listing: Sequence[FileInfo] | None,
    *,
    instance_id: str,
    owner: str,
    work: WorkDir,
    inline_bytes: int,
    public_url: str,
) -> list[dict[str, Any]]:
    """The run's outbox files as A2A artifacts (raw bytes when small, else a download URL).
    `listing`: the outbox as the agent listed it with the run's exit (None: list it now)."""
    entries = listing
    if entries is None:
        try:
            entries = await files.listing(instance_id, owner, work.outbox)
        except ProblemError as exc:
            raise TaskFileError(exc.detail) from None
    out: list[dict[str, Any]] = []
    for entry in sorted(entries, key=lambda e: e.name)[:MAX_OUTBOX]:
        if entry.type != "file" or "/" in entry.name or entry.name in ("", ".", ".."):
            continue
        path = posixpath.join(work.outbox, entry.name)
        part: dict[str, Any] = {"filename": entry.name, "mediaType": _media_type(entry.name)}
        if entry.size <= inline_bytes:
            try:
                data = await files.read(instance_id, owner, path, inline_bytes)
            except ProblemError as exc:
                raise TaskFileError(exc.detail) from None
            part["raw"] = base64.b64encode(data).decode()
        else:
            part["url"] = (
                f"{public_url.rstrip('/')}/api/v2/admin/instances/{quote(instance_id)}/files"
                f"?path={quote(path, safe='/')}"
            )
        out.append(
            {
                "artifactId": OUTBOX_ARTIFACT_PREFIX + entry.name,
                "name": entry.name,
                "parts": [part],
                "metadata": {"size": entry.size, "path": path},
            }
        )
    return out
