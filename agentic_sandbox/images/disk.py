"""Root filesystem -> ext4 raw file (mkfs.ext4 -d, no loop mounts) -> qcow2, and qemu-img info."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from agentic_sandbox.images.errors import BuildCancelled, BuildError, InvalidImage
from agentic_sandbox.images.process import CommandRunner

MIB = 1024 * 1024
_ROUND = 64 * MIB


def filesystem_geometry(
    content_bytes: int, inodes_used: int, free_space_mib: int
) -> tuple[int, int]:
    """(filesystem size in bytes, inode count) for a tree of `content_bytes` in `inodes_used`
    inodes plus `free_space_mib` of room. Sized for ext4 with 4 KiB blocks and 256-byte inodes:
    the data, +8% for metadata and directories, the inode tables, a journal, the free space."""
    free = free_space_mib * MIB
    inodes = int(inodes_used * 1.25) + free // 16384 + 8192
    journal = 64 * MIB if content_bytes + free > 512 * MIB else 32 * MIB
    raw = int(content_bytes * 1.08) + inodes * 256 + journal + free + 16 * MIB
    size = (raw + _ROUND - 1) // _ROUND * _ROUND
    return size, inodes


def make_ext4(
    runner: CommandRunner,
    mkfs: str,
    rootfs: Path,
    raw: Path,
    *,
    label: str,
    size: int,
    inodes: int,
    stage: str = "filesystem",
) -> int:
    """Write `rootfs` into a new ext4 filesystem in the regular file `raw`. Grows the file and
    retries (up to 3 times) if the estimate was too small. Returns the final size in bytes."""
    for _attempt in range(3):
        if raw.exists():
            raw.unlink()
        with open(raw, "wb") as f:
            f.truncate(size)
        try:
            runner.run(
                [
                    mkfs,
                    "-q",
                    "-F",
                    "-t",
                    "ext4",
                    "-b",
                    "4096",
                    "-I",
                    "256",
                    "-N",
                    str(inodes),
                    "-m",
                    "1",
                    "-L",
                    label,
                    # Initialise inode tables and journal now: otherwise every clone's kernel
                    # zeroes them lazily after boot, burning TCG time and growing each overlay.
                    "-E",
                    "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0",
                    "-d",
                    str(rootfs),
                    str(raw),
                ],
                stage=stage,
                timeout=1800,
            )
            return size
        except BuildError as err:
            if "exited" not in str(err):
                raise
            runner.write(f"# mkfs failed at {size // MIB} MiB; retrying 25% larger")
            size = (int(size * 1.25) + _ROUND - 1) // _ROUND * _ROUND
            inodes = int(inodes * 1.25)
    raise BuildError(stage, "mkfs.ext4 -d failed three times (see build log)", runner.log.name)


def convert_to_qcow2(
    runner: CommandRunner, qemu_img: str, raw: Path, out: Path, *, compression: str
) -> None:
    options = "cluster_size=65536"
    if compression != "none":
        options += f",compression_type={compression}"
    argv = [qemu_img, "convert", "-q", "-f", "raw", "-O", "qcow2", "-o", options]
    if compression != "none":
        argv.append("-c")
    argv += [str(raw), str(out)]
    runner.run(argv, stage="convert", timeout=1800)


def qemu_img_info(path: Path, qemu_img: str = "qemu-img", timeout: float = 60) -> dict[str, Any]:
    """`qemu-img info --output=json` of `path` (format auto-detected, backing chain not
    followed). Raises InvalidImage when qemu-img cannot read it."""
    try:
        proc = subprocess.run(
            [qemu_img, "info", "--output=json", str(path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InvalidImage(f"{path}: qemu-img info failed: {err}") from None
    if proc.returncode != 0:
        msg = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "unknown error"
        raise InvalidImage(f"{path}: not a readable disk image: {msg}")
    try:
        info = json.loads(proc.stdout)
    except ValueError:
        raise InvalidImage(f"{path}: qemu-img info printed no JSON") from None
    if not isinstance(info, dict):
        raise InvalidImage(f"{path}: qemu-img info printed unexpected JSON")
    return info


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            if cancel is not None and cancel.is_set():
                raise BuildCancelled("build cancelled")
            chunk = f.read(4 * MIB)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512
