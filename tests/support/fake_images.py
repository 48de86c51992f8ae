"""Shared fakes for the images unit tests: a complete-looking image and fake build tools."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from agentic_sandbox.images import ImageStore, Manifest
from agentic_sandbox.images.manifest import BootInfo, DiskInfo, GuestInfo


def fake_manifest(name: str, disk_bytes: bytes, recipe_name: str = "fake") -> Manifest:
    return Manifest(
        name=name,
        kind="built",
        recipe_name=recipe_name,
        recipe={"name": recipe_name},
        content_hash="0" * 64,
        builder_version="1",
        created_at="2025-01-01T00:00:00Z",
        disk=DiskInfo(
            file="disk.qcow2",
            format="qcow2",
            virtual_size=1 << 20,
            actual_size=len(disk_bytes),
            sha256=hashlib.sha256(disk_bytes).hexdigest(),
        ),
        boot=BootInfo(
            direct_kernel=True,
            kernel="vmlinuz",
            initrd="initrd.img",
            kernel_version="6.1.0-1-cloud-amd64",
            root_label="agentic-root",
            cmdline="root=LABEL=agentic-root ro console=ttyS0",
        ),
        guest=GuestInfo(agent_python="/opt/agentic-sandbox/venv/bin/python"),
        agent_runtime_baked=True,
    )


def write_image_files(path: Path, name: str, recipe_name: str = "fake") -> None:
    disk = b"QFI\xfb" + b"\0" * 100
    path.mkdir(parents=True, exist_ok=True)
    (path / "disk.qcow2").write_bytes(disk)
    (path / "vmlinuz").write_bytes(b"kernel")
    (path / "initrd.img").write_bytes(b"initrd")
    (path / "build.log").write_text("log\n")
    (path / "manifest.json").write_text(fake_manifest(name, disk, recipe_name).to_json())


def publish_fake(store: ImageStore, name: str, recipe_name: str = "fake") -> None:
    with store.staging(name) as tmp:
        write_image_files(tmp, name, recipe_name)
        store.publish(tmp, name)


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path
