"""manifest.json of an image, and BuiltImage: what callers get back for a complete image."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentic_sandbox.images.errors import InvalidImage

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

ImageKind = Literal["built", "cloud"]


class _Model(BaseModel):
    # Manifests are the builder's own output: unknown keys (from a newer builder) are ignored on
    # read so that an image stays usable; written manifests are always complete.
    model_config = ConfigDict(extra="ignore", frozen=True)


class DiskInfo(_Model):
    file: str
    format: Literal["qcow2"]
    virtual_size: int = Field(ge=0)
    actual_size: int = Field(ge=0)
    #: qcow2 compression type of the clusters: none, zlib or zstd.
    compression: str = "none"
    sha256: str


class BootInfo(_Model):
    """How to boot the image. `direct_kernel` images boot with -kernel/-initrd/-append only."""

    direct_kernel: bool
    kernel: str | None = None
    initrd: str | None = None
    kernel_version: str | None = None
    root_label: str | None = None
    cmdline: str | None = None


class GuestInfo(_Model):
    """Facts about the guest that provisioning relies on (None when unknown, e.g. cloud images)."""

    distribution: str | None = None
    suite: str | None = None
    python: str | None = None
    python_version: str | None = None
    agent_venv: str | None = None
    agent_python: str | None = None
    agent_packages: dict[str, str] = Field(default_factory=dict)
    cloud_init_version: str | None = None
    systemd_version: str | None = None
    package_count: int = 0
    users: list[str] = Field(default_factory=list)
    groups: list[str] = Field(default_factory=list)
    nocloud_label: str = "cidata"


class Manifest(_Model):
    manifest_version: Literal[1] = 1
    name: str
    kind: ImageKind
    recipe_name: str | None = None
    #: The recipe as validated (kind `built`); None for cloud images.
    recipe: dict[str, Any] | None = None
    #: Recipe content hash (kind `built`) or sha256 of the imported file (kind `cloud`).
    content_hash: str
    builder_version: str
    created_at: str
    disk: DiskInfo
    boot: BootInfo
    guest: GuestInfo
    #: Whether the agent runtime (venv) is in the image; if not, cloud-init must install it.
    agent_runtime_baked: bool
    sizes: dict[str, int] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    source: str | None = None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def read_manifest(image_dir: Path) -> Manifest:
    path = image_dir / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidImage(f"{path}: unreadable manifest: {err}") from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidImage(f"{path}: invalid manifest: {loc}: {first['msg']}") from None


@dataclass(frozen=True)
class BuiltImage:
    """A complete image in the cache. Paths are absolute; every file is read-only (0444)."""

    path: Path
    manifest: Manifest
    #: True when `build()` found the image already in the cache.
    cached: bool = False

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def kind(self) -> ImageKind:
        return self.manifest.kind

    @property
    def disk(self) -> Path:
        """The qcow2 base image: use it as a read-only backing file for per-instance overlays."""
        return self.path / self.manifest.disk.file

    @property
    def disk_format(self) -> str:
        return self.manifest.disk.format

    @property
    def kernel(self) -> Path | None:
        k = self.manifest.boot.kernel
        return self.path / k if k else None

    @property
    def initrd(self) -> Path | None:
        i = self.manifest.boot.initrd
        return self.path / i if i else None

    @property
    def kernel_cmdline(self) -> str | None:
        return self.manifest.boot.cmdline

    @property
    def direct_kernel_boot(self) -> bool:
        return self.manifest.boot.direct_kernel

    @property
    def agent_runtime_baked(self) -> bool:
        return self.manifest.agent_runtime_baked

    @property
    def needs_agent_runtime(self) -> bool:
        """True when cloud-init must install the agent runtime at first boot (cloud images)."""
        return not self.manifest.agent_runtime_baked

    @property
    def agent_python(self) -> str | None:
        """The guest path of the venv's python that runs agent-client, when baked in."""
        return self.manifest.guest.agent_python

    @property
    def build_log(self) -> Path:
        return self.path / "build.log"
