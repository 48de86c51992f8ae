"""e2e: build debian-12-agent for real (cached across runs), then boot it under QEMU TCG.

The image lives in $SANDBOX_TEST_CACHE (default /var/tmp/agentic-sandbox-test-cache) and is
reused while the recipe hash is unchanged, so only the first run pays for the build (~70 s).
Needs root, debootstrap, e2fsprogs, qemu-utils, qemu-system-x86 and the Debian archive + PyPI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentic_sandbox.images import BuiltImage, ImageBuilder, ImageStore, Progress

sys.path.insert(0, str(Path(__file__).parent))
from images_guest_boot import boot_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

CACHE = Path(os.environ.get("SANDBOX_TEST_CACHE", "/var/tmp/agentic-sandbox-test-cache"))
BOOT_TIMEOUT_S = 240.0


def _require_tools() -> None:
    missing = [
        t
        for t in ("debootstrap", "mkfs.ext4", "qemu-img", "qemu-system-x86_64", "chroot")
        if shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin") is None
    ]
    if os.geteuid() != 0:
        pytest.fail("the images e2e tier needs root (debootstrap, chroot, mount)")
    if missing:
        pytest.fail(
            f"missing tools for the images e2e tier: {', '.join(missing)} "
            "(apt-get install debootstrap e2fsprogs qemu-utils qemu-system-x86)"
        )


@pytest.fixture(scope="module")
def built() -> tuple[BuiltImage, list[Progress], float]:
    _require_tools()
    events: list[Progress] = []
    t0 = time.monotonic()
    image = ImageBuilder(CACHE).build("debian-12-agent", progress=events.append)
    return image, events, time.monotonic() - t0


def test_build_produces_a_complete_readonly_image(
    built: tuple[BuiltImage, list[Progress], float],
) -> None:
    image, events, seconds = built
    m = image.manifest
    print(f"\nimage {image.name}: {'cache hit' if image.cached else 'built'} in {seconds:.1f} s")
    prefix = "debian-12-agent-"
    assert image.name.startswith(prefix) and len(image.name) == len(prefix) + 12
    assert events and events[-1].fraction == 1.0
    if not image.cached:
        stages = [e.stage for e in events]
        for stage in ("debootstrap", "customize", "runtime", "filesystem", "convert", "done"):
            assert stage in stages
        fractions = [e.fraction for e in events]
        assert fractions == sorted(fractions)
    # files: disk, kernel, initrd, manifest, log; all read-only, dirs traversable
    for f in (
        image.disk,
        image.kernel,
        image.initrd,
        image.path / "manifest.json",
        image.build_log,
        image.path / "packages.txt",
    ):
        assert f is not None and f.is_file(), f
        assert f.stat().st_mode & 0o777 == 0o444, f
    assert image.path.stat().st_mode & 0o777 == 0o755
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", str(image.disk)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert info["format"] == "qcow2"
    assert info["virtual-size"] == m.disk.virtual_size
    assert m.boot.kernel_version and m.boot.kernel_version.endswith("-cloud-amd64")
    assert m.boot.cmdline == "root=LABEL=agentic-root ro console=ttyS0,115200n8 net.ifnames=0"
    assert m.guest.agent_python == "/opt/agentic-sandbox/venv/bin/python"
    assert {"grpcio", "protobuf", "ptyprocess"} <= set(m.guest.agent_packages)
    assert m.agent_runtime_baked and not image.needs_agent_runtime
    assert "cloud-init" in (image.path / "packages.txt").read_text()
    # nothing half-built is left behind
    assert not any(ImageStore(CACHE).tmp_dir.glob(f"{image.name}.*"))


def test_second_build_is_a_fast_cache_hit(
    built: tuple[BuiltImage, list[Progress], float],
) -> None:
    image, _, _ = built
    again = ImageBuilder(CACHE).build("debian-12-agent")  # (its speed: bench_images.py)
    assert again.cached and again.name == image.name and again.disk == image.disk


def test_image_boots_and_cloud_init_runs_the_agent_runtime(
    built: tuple[BuiltImage, list[Progress], float], tmp_path: Path
) -> None:
    image, _, _ = built
    assert image.kernel and image.initrd and image.kernel_cmdline
    result = boot_until(
        base=image.disk,
        kernel=image.kernel,
        initrd=image.initrd,
        cmdline=image.kernel_cmdline,
        workdir=tmp_path,
        timeout=BOOT_TIMEOUT_S,
        instance_id=f"iid-e2e-{os.getpid()}",
    )
    tail = "\n".join(result.serial.splitlines()[-40:])
    print(f"\nboot timings (s): {result.seconds_to}\nfacts: {result.facts}")
    assert not result.timed_out, f"no cloud-init final message in {BOOT_TIMEOUT_S} s:\n{tail}"
    assert "runcmd" in result.seconds_to, f"runcmd marker missing:\n{tail}"
    assert result.venv_line.startswith("AGENTIC-E2E-VENV-OK"), f"venv import failed:\n{tail}"
    f = result.facts
    assert len(f.get("machine_id", "")) == 32, f  # generated at boot (image ships it empty)
    assert int(f.get("host_keys", "0")) >= 1, f  # made per clone (image ships none)
    assert f.get("label") == "agentic-root" and f.get("fstype") == "ext4", f
    assert f.get("kernel") == image.manifest.boot.kernel_version, f
    assert f.get("resolv_bytes") == "0", f  # the build host's resolv.conf never leaks in
    assert f.get("hostname") == "e2e-guest", f  # from the seed's meta-data
    assert f.get("eth0") == "10.0.2.15/24" and f.get("default_routes") == "0", f
