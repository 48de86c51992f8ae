"""Importing a user-supplied cloud image (qcow2 with cloud-init) into the cache.

Such an image boots through its own bootloader (no direct kernel boot) and has no agent runtime:
its manifest says `kind: cloud` and `agent_runtime_baked: false`, so provisioning knows that
cloud-init must install the runtime (python3-venv + the agent's wheels) at first boot.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from datetime import UTC, datetime
from pathlib import Path

from agentic_sandbox.images.disk import qemu_img_info
from agentic_sandbox.images.errors import BuildCancelled, InvalidImage
from agentic_sandbox.images.manifest import (
    MANIFEST_NAME,
    BootInfo,
    BuiltImage,
    DiskInfo,
    GuestInfo,
    Manifest,
)
from agentic_sandbox.images.progress import ProgressCallback, ProgressTracker
from agentic_sandbox.images.recipe import BUILDER_VERSION
from agentic_sandbox.images.store import ImageStore

DISK_FILE = "disk.qcow2"
_CHUNK = 4 * 1024 * 1024
_IMPORT_STAGES = (("validate", 0.05), ("copy", 0.9), ("finalize", 0.05))


def validate_cloud_image(path: Path, qemu_img: str = "qemu-img") -> dict[str, object]:
    """qemu-img info of `path`, checked to be a self-contained, unencrypted, sane qcow2."""
    if not path.is_file():
        raise InvalidImage(f"{path}: no such file")
    info = qemu_img_info(path, qemu_img)
    fmt = info.get("format")
    if fmt != "qcow2":
        raise InvalidImage(f"{path}: format is {fmt!r}, a cloud image must be qcow2")
    if info.get("backing-filename") or info.get("full-backing-filename"):
        raise InvalidImage(f"{path}: has a backing file; import a standalone (flattened) image")
    if info.get("encrypted"):
        raise InvalidImage(f"{path}: is encrypted")
    vsize = info.get("virtual-size")
    if not isinstance(vsize, int) or vsize <= 0:
        raise InvalidImage(f"{path}: has no virtual size")
    specific = info.get("format-specific")
    data = specific.get("data", {}) if isinstance(specific, dict) else {}
    if isinstance(data, dict) and data.get("corrupt"):
        raise InvalidImage(f"{path}: qcow2 is marked corrupt")
    return info


def _compression_type(info: dict[str, object]) -> str:
    specific = info.get("format-specific")
    data = specific.get("data") if isinstance(specific, dict) else None
    value = data.get("compression-type") if isinstance(data, dict) else None
    return str(value) if value else "none"


def _base_name(path: Path, name: str | None) -> str:
    raw = name if name is not None else "cloud-" + path.name.split(".")[0]
    base = re.sub(r"[^a-z0-9.-]+", "-", raw.lower()).strip("-.")[:40].rstrip("-.")
    if not base or not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", base):
        raise InvalidImage(f"cannot derive an image name from {raw!r}")
    return base


def _copy_hashing(src: Path, dst: Path, cancel: threading.Event, report: ProgressTracker) -> str:
    digest = hashlib.sha256()
    total = max(1, src.stat().st_size)
    done = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while True:
            if cancel.is_set():
                raise BuildCancelled("import cancelled")
            chunk = fin.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            fout.write(chunk)
            done += len(chunk)
            if done % (64 * _CHUNK) < _CHUNK:
                report.report("copy", done / total, f"{done >> 20} of {total >> 20} MiB")
        fout.flush()
        os.fsync(fout.fileno())
    return digest.hexdigest()


def _hash_only(src: Path, cancel: threading.Event) -> str:
    digest = hashlib.sha256()
    with open(src, "rb") as f:
        while chunk := f.read(_CHUNK):
            if cancel.is_set():
                raise BuildCancelled("import cancelled")
            digest.update(chunk)
    return digest.hexdigest()


def import_cloud_image(
    store: ImageStore,
    path: Path | str,
    *,
    name: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    link: bool = False,
    qemu_img: str = "qemu-img",
) -> BuiltImage:
    """Validate `path` (qemu-img info) and add it to the cache as `<name>-<sha256[:12]>`.

    The file is copied (hashing while copying), or hard-linked with `link=True` when on the same
    filesystem — note that a link shares the inode, so the source becomes read-only (0444) too.
    Importing the same bytes again returns the cached image.
    """
    src = Path(path).absolute()
    cancel = cancel if cancel is not None else threading.Event()
    tracker = ProgressTracker(progress, _IMPORT_STAGES)
    tracker.report("validate", 0.0, f"checking {src}")
    info = validate_cloud_image(src, qemu_img)
    base = _base_name(src, name)
    with store.staging(f"{base}-import") as tmp:
        disk = tmp / DISK_FILE
        linked = False
        if link and os.stat(src).st_dev == os.stat(tmp).st_dev:
            digest = _hash_only(src, cancel)
            os.link(src, disk)
            linked = True
        else:
            digest = _copy_hashing(src, disk, cancel, tracker)
        image_name = f"{base}-{digest[:12]}"
        with store.lock(image_name, cancel):
            hit = store.find(image_name)
            if hit is not None:
                tracker.report("done", 1.0, f"{image_name} is in the cache")
                return BuiltImage(path=hit.path, manifest=hit.manifest, cached=True)
            tracker.report("finalize", 0.0, "writing manifest")
            # Re-check what we actually hold (the source may have changed under us).
            copy_info = validate_cloud_image(disk, qemu_img)
            vsize = copy_info.get("virtual-size")
            manifest = Manifest(
                name=image_name,
                kind="cloud",
                recipe_name=None,
                recipe=None,
                content_hash=digest,
                builder_version=BUILDER_VERSION,
                created_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                disk=DiskInfo(
                    file=DISK_FILE,
                    format="qcow2",
                    virtual_size=vsize if isinstance(vsize, int) else 0,
                    actual_size=disk.stat().st_size,
                    compression=_compression_type(copy_info),
                    sha256=digest,
                ),
                boot=BootInfo(direct_kernel=False),
                guest=GuestInfo(),
                agent_runtime_baked=False,
                sizes={"qcow2_bytes": disk.stat().st_size},
                timings={},
                source=str(src) + (" (hard link)" if linked else ""),
            )
            (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
            (tmp / "build.log").write_text(
                f"imported {src}\nsha256 {digest}\nqemu-img info: {info.get('format')} "
                f"virtual-size {info.get('virtual-size')}\n",
                encoding="utf-8",
            )
            image = store.publish(tmp, image_name)
    tracker.report("done", 1.0, f"imported {image.name}")
    return image
