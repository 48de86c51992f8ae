"""Benchmark: provisioning on real libvirtd + QEMU (TCG), through the server's API.

    .venv/bin/python tests/bench/bench_provision.py [--snapshots N] [--pool N]

Measures image reuse (cached build), create → agent ready cold, from a memory snapshot and from
the warm pool, with every stage's time (p50 over the runs). Prints a table and writes
bench-results/provision.json. Needs root, libvirtd and the image cache of the test run
($SANDBOX_TEST_CACHE); builds the image there when it is missing. Every VM it makes is deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.server import ServerProcess  # noqa: E402

CACHE = Path(os.environ.get("SANDBOX_TEST_CACHE", "/var/tmp/agentic-sandbox-test-cache"))
RECIPE = "debian-12-agent"


def wait_op(srv: ServerProcess, op: dict[str, Any], limit: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while op["state"] not in ("succeeded", "failed", "canceled"):
        if time.monotonic() > deadline:
            raise SystemExit(f"operation {op['id']} still {op['state']} after {limit}s")
        time.sleep(0.2)
        op = srv.ok("GET", f"/api/v2/admin/operations/{op['id']}")
    if op["state"] != "succeeded":
        raise SystemExit(f"operation failed: {op.get('error')}")
    return op


def create(srv: ServerProcess, body: dict[str, Any], limit: float = 600) -> tuple[float, dict]:
    started = time.monotonic()
    status, op = srv.api("POST", "/api/v2/admin/instances", body)
    if status != 202:
        raise SystemExit(f"create refused: {status} {op}")
    op = wait_op(srv, op, limit)
    return time.monotonic() - started, {s["name"]: s["seconds"] or 0.0 for s in op["stages"]}


def summarize(runs: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    stages: dict[str, list[float]] = {}
    for _, st in runs:
        for name, secs in st.items():
            stages.setdefault(name, []).append(secs)
    return {
        "runs": len(runs),
        "p50_seconds": round(statistics.median(t for t, _ in runs), 3),
        "max_seconds": round(max(t for t, _ in runs), 3),
        "stages_p50": {k: round(statistics.median(v), 3) for k, v in stages.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshots", type=int, default=3, help="clones from a memory snapshot")
    ap.add_argument("--pool", type=int, default=3, help="creates from the warm pool")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (libvirt qemu:///system)")
    data = Path(tempfile.mkdtemp(prefix="sbx-bench-", dir="/var/tmp"))
    data.chmod(0o755)
    srv = ServerProcess(
        data / "data",
        env={
            "SANDBOX_LIBVIRT_URI": "qemu:///system",
            "SANDBOX_IMAGES_DIR": str(CACHE),
            "SANDBOX_KVM_PROBE": "false",
            "SANDBOX_AGENT_HEARTBEAT_SECONDS": "2",
        },
    )
    (data / "data").chmod(0o755)
    srv.start()
    made: list[str] = []
    results: dict[str, Any] = {}
    try:
        started = time.monotonic()
        op = wait_op(srv, srv.ok("POST", "/api/v2/admin/images", {"recipe": RECIPE}), 1800)
        results["image_build"] = {
            "seconds": round(time.monotonic() - started, 3),
            "cached": op["result"]["cached"],
        }
        started = time.monotonic()
        op = wait_op(srv, srv.ok("POST", "/api/v2/admin/images", {"recipe": RECIPE}), 60)
        results["image_reuse"] = {
            "seconds": round(time.monotonic() - started, 3),
            "cached": op["result"]["cached"],
        }

        made.append("bench-cold")
        cold = create(srv, {"id": "bench-cold", "image": RECIPE})
        results["cold"] = summarize([cold])

        srv.ok(
            "POST",
            "/api/v2/admin/instances/bench-cold/snapshots",
            {"name": "golden", "memory": True},
        )
        snaps = []
        for i in range(args.snapshots):
            iid = f"bench-snap-{i}"
            made.append(iid)
            snaps.append(create(srv, {"id": iid, "from_snapshot": "bench-cold/golden"}, 180))
            srv.ok("DELETE", f"/api/v2/admin/instances/{iid}")
            made.remove(iid)
        if snaps:
            results["from_snapshot"] = summarize(snaps)

        if args.pool:
            pool_op = srv.ok(
                "POST", "/api/v2/admin/pools", {"image": RECIPE, "loadout": "minimal", "size": 1}
            )
            wait_op(srv, pool_op, 900)
            pooled = []
            for i in range(args.pool):
                deadline = time.monotonic() + 300
                while srv.ok("GET", "/api/v2/admin/pools")["items"][0]["ready"] < 1:
                    if time.monotonic() > deadline:
                        raise SystemExit("the pool did not refill")
                    time.sleep(0.5)
                iid = f"bench-pool-{i}"
                made.append(iid)
                pooled.append(create(srv, {"id": iid, "image": RECIPE, "from_pool": True}, 180))
                srv.ok("DELETE", f"/api/v2/admin/instances/{iid}")
                made.remove(iid)
            results["from_pool"] = summarize(pooled)
            for pool in srv.ok("GET", "/api/v2/admin/pools")["items"]:
                srv.ok("DELETE", f"/api/v2/admin/pools/{pool['key']}")
    finally:
        for iid in made:
            srv.api("DELETE", f"/api/v2/admin/instances/{iid}")
        status, pools = srv.api("GET", "/api/v2/admin/pools")
        for pool in pools.get("items", []) if status == 200 else []:
            srv.api("DELETE", f"/api/v2/admin/pools/{pool['key']}")
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)

    targets = {"image_reuse": 2.0, "cold": 60.0, "from_snapshot": 5.0, "from_pool": 1.5}
    print(f"\n{'measure':<16}{'p50 s':>9}{'max s':>9}{'target s':>10}  stages (p50 s)")
    for key in ("image_build", "image_reuse", "cold", "from_snapshot", "from_pool"):
        r = results.get(key)
        if r is None:
            continue
        p50 = r.get("p50_seconds", r.get("seconds"))
        mx = r.get("max_seconds", p50)
        stages = " ".join(f"{k}={v}" for k, v in r.get("stages_p50", {}).items())
        tgt = targets.get(key)
        print(f"{key:<16}{p50:>9.2f}{mx:>9.2f}{(f'{tgt:.1f}' if tgt else '-'):>10}  {stages}")
    out = ROOT / "bench-results" / "provision.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": os.uname().nodename, "results": results, "targets": targets}, indent=2
        )
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
