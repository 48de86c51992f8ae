"""Benchmark: image build (cold) and cached reuse; optionally cold boot to cloud-init done.

    .venv/bin/python tests/bench/bench_images.py [--cold] [--boot] [--reuse-runs N]

Uses the e2e cache ($SANDBOX_TEST_CACHE, default /var/tmp/agentic-sandbox-test-cache). Without
`--cold`, the build is cold only if the image is not cached yet; otherwise the build timings the
manifest recorded at build time are reported (marked `recorded`). `--cold` builds into a fresh
temporary cache dir (downloads everything again) and removes it afterwards. Needs root for builds.
Prints a table and writes bench-results/images.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests/e2e/images"))

from agentic_sandbox.images import BuiltImage, ImageBuilder  # noqa: E402
from agentic_sandbox.images.mounts import remove_tree  # noqa: E402

CACHE = Path(os.environ.get("SANDBOX_TEST_CACHE", "/var/tmp/agentic-sandbox-test-cache"))
RECIPE = "debian-12-agent"


def _mib(n: int | float) -> str:
    return f"{n / 2**20:.0f} MiB"


def build_section(image: BuiltImage, seconds: float, source: str) -> dict[str, Any]:
    m = image.manifest
    return {
        "image": image.name,
        "source": source,
        "wall_s": round(seconds, 2),
        "stages_s": m.timings,
        "qcow2_bytes": m.disk.actual_size,
        "virtual_bytes": m.disk.virtual_size,
        "rootfs_bytes": m.sizes.get("rootfs_bytes"),
        "kernel_bytes": m.sizes.get("kernel_bytes"),
        "initrd_bytes": m.sizes.get("initrd_bytes"),
        "compression": m.disk.compression,
        "packages": m.guest.package_count,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="build into a fresh temp cache")
    ap.add_argument("--boot", action="store_true", help="also measure a cold boot (TCG)")
    ap.add_argument("--reuse-runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results/images.json")
    args = ap.parse_args()
    load_start = os.getloadavg()

    results: dict[str, Any] = {
        "bench": "images",
        "recipe": RECIPE,
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
        },
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    rows: list[tuple[str, str]] = []

    temp_cache: Path | None = None
    cache = CACHE
    if args.cold:
        temp_cache = Path(tempfile.mkdtemp(prefix="images-bench-", dir="/var/tmp"))
        cache = temp_cache
    try:
        builder = ImageBuilder(cache)
        was_cached = builder.cached(RECIPE) is not None
        t0 = time.monotonic()
        image = builder.build(RECIPE)
        wall = time.monotonic() - t0
        source = "recorded" if was_cached else "measured"
        build = build_section(
            image, image.manifest.timings.get("total", wall) if was_cached else wall, source
        )
        results["cold_build"] = build
        rows.append((f"cold build ({source})", f"{build['wall_s']:.1f} s"))
        for stage, secs in image.manifest.timings.items():
            if stage != "total":
                rows.append((f"  stage {stage}", f"{secs:.1f} s"))
        rows.append(("image qcow2 size", f"{_mib(build['qcow2_bytes'])} ({build['compression']})"))
        rows.append(("  filesystem (virtual)", _mib(build["virtual_bytes"])))
        rows.append(("  files in rootfs", _mib(build["rootfs_bytes"] or 0)))
        rows.append(
            ("  kernel + initrd", _mib((build["kernel_bytes"] or 0) + (build["initrd_bytes"] or 0)))
        )

        reuse: list[float] = []
        for _ in range(max(1, args.reuse_runs)):
            t0 = time.monotonic()
            again = ImageBuilder(cache).build(RECIPE)
            reuse.append(time.monotonic() - t0)
            assert again.cached
        results["cached_reuse_s"] = {
            "runs": len(reuse),
            "p50": round(statistics.median(reuse), 4),
            "max": round(max(reuse), 4),
            "target": 2.0,
        }
        rows.append(
            (
                "cached reuse p50 / max",
                f"{statistics.median(reuse) * 1000:.1f} / {max(reuse) * 1000:.1f} ms",
            )
        )

        if args.boot:
            from images_guest_boot import boot_until

            assert image.kernel and image.initrd and image.kernel_cmdline
            with tempfile.TemporaryDirectory(prefix="images-boot-", dir="/var/tmp") as wd:
                r = boot_until(
                    base=image.disk,
                    kernel=image.kernel,
                    initrd=image.initrd,
                    cmdline=image.kernel_cmdline,
                    workdir=Path(wd),
                    timeout=240,
                    instance_id=f"iid-bench-{os.getpid()}",
                )
            results["cold_boot_s"] = {
                **r.seconds_to,
                "timed_out": r.timed_out,
                "vcpus": 1,
                "memory_mib": 512,
                "accel": "tcg",
            }
            for k, v in r.seconds_to.items():
                rows.append((f"cold boot -> {k} (TCG, 1 vCPU)", f"{v:.1f} s"))
            if r.timed_out:
                rows.append(("cold boot", "TIMED OUT (240 s)"))
    finally:
        if temp_cache is not None:
            remove_tree(temp_cache)

    load_end = os.getloadavg()
    results["host"]["loadavg_at_start"] = [round(x, 2) for x in load_start]
    results["host"]["loadavg_at_end"] = [round(x, 2) for x in load_end]
    rows.append(
        (
            "load average start -> end",
            " -> ".join(" ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end)),
        )
    )
    width = max(len(k) for k, _ in rows)
    print(f"\nimages benchmark ({RECIPE})")
    print("-" * (width + 20))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
