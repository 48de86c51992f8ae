"""The files API's queries and answers (`/api/v2/admin/instances/{id}/files`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, StringConstraints

from agentic_sandbox.broker.http.schemas import Input, Output


def _flag(value: object) -> object:
    """`?list` (present, empty), `?list=true|1|yes`, `?list=false|0|no`."""
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("", "true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
    return value


Flag = Annotated[bool, BeforeValidator(_flag)]
GuestPath = Annotated[
    str,
    StringConstraints(pattern=r"^/[^\x00]*$", max_length=4096),
    Field(description="absolute path in the guest (no `..`, no empty components)"),
]
Mode = Annotated[
    str,
    StringConstraints(pattern=r"^0?[0-7]{3,4}$"),
    Field(description="permission bits in octal (0644)"),
]
Name = Annotated[str, StringConstraints(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")]


class FileGet(Input):
    path: GuestPath
    list: Flag = Field(default=False, description="list the directory (`?list`)")
    stat: Flag = Field(default=False, description="stat the path (`?stat`)")
    follow_symlinks: Flag = False
    limit: int | None = Field(default=None, ge=1, le=10_000, description="entries of a list")


class FileQuery(Input):
    path: GuestPath
    follow_symlinks: Flag = False
    limit: int | None = Field(default=None, ge=1, le=10_000, description="entries of a list")


class FilePut(Input):
    path: GuestPath
    directory: Flag = Field(
        default=False, description="the body is a tar stream (also: Content-Type application/x-tar)"
    )
    mode: Mode | None = None
    owner: Name | None = None
    group: Name | None = None
    parents: Flag = Field(default=False, description="make missing parent directories")
    follow_symlinks: Flag = False
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")] | None = Field(
        default=None, description="the body's SHA-256: checked before anything is kept"
    )


class FileDelete(Input):
    path: GuestPath
    recursive: Flag = False


class MkdirRequest(Input):
    path: GuestPath
    parents: bool = False
    mode: Mode | None = None
    owner: Name | None = None
    group: Name | None = None


class FileInfoOut(Output):
    path: str
    name: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    mode: str = Field(description="permission bits in octal")
    uid: int
    gid: int
    owner: str
    group: str
    mtime: float = Field(description="seconds since the epoch")
    link_target: str | None = None


class FileListOut(Output):
    path: str
    items: list[FileInfoOut]
    truncated: bool = Field(description="more entries than were listed")


class UploadOut(Output):
    path: str
    size: int = Field(description="bytes received (the tar stream's for a directory)")
    sha256: str
    directory: bool
    entries: int | None = Field(description="members unpacked (a directory)")


class RemovedOut(Output):
    path: str
    removed: int = Field(description="entries removed")
