"""`sandboxctl instance push ID LOCAL REMOTE`, `instance pull ID REMOTE LOCAL`,
`instance ls ID PATH` — files over the agent link, through the SDK (`instances.files`).

A local directory is pushed as a tar stream and becomes the directory REMOTE; a remote
directory is pulled as one and unpacked as LOCAL. On a terminal a progress bar (rich) shows
the bytes moved; `-o json|yaml` prints the result document instead of a line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from agentic_sandbox.sandboxctl.output import _console, doc, emit
from agentic_sandbox.sdk import AsyncClient
from agentic_sandbox.sdk.errors import ApiError

LS_COLS = ["name", "type", "size", "mode", "owner", "group", "mtime"]


@contextmanager
def byte_progress(title: str) -> Iterator[Callable[[int, int | None], None]]:
    """A bytes progress bar on stderr (nothing when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        yield lambda _done, _total: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=_console(sys.stderr),
    ) as bar:
        task = bar.add_task(title, total=None)

        def update(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def add_push(v: argparse.ArgumentParser) -> None:
    v.add_argument("id")
    v.add_argument("local", help="a file or a directory (sent as a tar stream)")
    v.add_argument("remote", help="absolute path in the instance")
    v.add_argument("--mode", help="permission bits in octal (default: the replaced file's, 0644)")
    v.add_argument("--owner", help="user in the instance (default: the replaced file's)")
    v.add_argument("--group")
    v.add_argument("--parents", "-p", action="store_true", help="make missing directories")


def add_pull(v: argparse.ArgumentParser) -> None:
    v.add_argument("id")
    v.add_argument("remote", help="absolute path in the instance (a directory comes as tar)")
    v.add_argument("local", help="local path ('-': standard output)")
    v.add_argument("--follow-symlinks", action="store_true")


def add_ls(v: argparse.ArgumentParser) -> None:
    v.add_argument("id")
    v.add_argument("path", help="absolute path in the instance")
    v.add_argument("--follow-symlinks", action="store_true")


async def instance_push(c: AsyncClient, a: argparse.Namespace) -> None:
    with byte_progress(f"push {a.local}") as update:
        out = await c.instances.files.upload(
            a.id,
            a.local,
            a.remote,
            mode=int(a.mode, 8) if a.mode else None,
            owner=a.owner,
            group=a.group,
            parents=a.parents,
            progress=update,
        )
    if a.output == "table":
        print(f"{out.path}: {out.size} bytes, sha256 {out.sha256}")
    else:
        emit(doc(out), a.output)


async def instance_pull(c: AsyncClient, a: argparse.Namespace) -> None:
    files = c.instances.files
    if a.local == "-":
        out = await files.download(
            a.id, a.remote, sys.stdout.buffer, follow_symlinks=a.follow_symlinks
        )
        sys.stdout.buffer.flush()
        return
    with byte_progress(f"pull {a.remote}") as update:
        out = await files.download(
            a.id, a.remote, a.local, follow_symlinks=a.follow_symlinks, progress=update
        )
    if a.output == "table":
        print(f"{a.local}: {out.size} bytes ({out.type}), sha256 {out.sha256}")
    else:
        emit(out._asdict(), a.output)


def _ls_row(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as the table shows it: mtime (seconds since the epoch) as a UTC time."""
    mtime = entry.get("mtime")
    if isinstance(mtime, int | float):
        when = dt.datetime.fromtimestamp(mtime, dt.UTC)
        entry = {**entry, "mtime": when.strftime("%Y-%m-%d %H:%M:%S")}
    return entry


async def instance_ls(c: AsyncClient, a: argparse.Namespace) -> None:
    """A directory's entries; a path that is not a directory lists itself, as `ls` does."""
    try:
        listing = await c.instances.files.list(a.id, a.path, follow_symlinks=a.follow_symlinks)
    except ApiError as exc:
        if exc.code != "not-a-directory":
            raise
        one = await c.instances.files.stat(a.id, a.path, follow_symlinks=a.follow_symlinks)
        if a.output != "table":
            emit(doc(one), a.output)
        else:
            emit([_ls_row(one.to_dict())], a.output, LS_COLS)
        return
    if a.output != "table":
        emit(doc(listing), a.output)
        return
    emit([_ls_row(e.to_dict()) for e in listing.items], a.output, LS_COLS)
    if listing.truncated:
        print(f"(more entries than listed in {listing.path})", file=sys.stderr)
