"""Benchmark: provisioning on real libvirtd + QEMU (TCG), through the server's API.

    .venv/bin/python tests/bench/bench_provision.py [--restarts N] [--snapshots N] [--pool N]
        [--pool-age S] [--agent-restarts N] [--logs DIR]

Measures the server's own start → ready (`/readyz`) the first time (the KVM probe boots a
kernel) and on restarts (the probe's answer is remembered), image reuse (cached build),
create → agent ready cold, from a memory snapshot (the first clone right after the snapshot
apart from later ones), a server restart with three guests running (→ ready, and ready →
every agent reconnected), and from the warm pool (`--pool-age`: let each member wait first, as
a pool is meant to be used), with every stage's time (p50 over the runs) and the load average
at start and end. Prints a table and writes bench-results/provision.json. Needs root,
libvirtd and the image cache of the test run ($SANDBOX_TEST_CACHE); builds the image there when
it is missing. Every VM it makes is deleted; `--logs DIR` first keeps each guest's agent journal
(to the millisecond, through the exec API) and the server's log there, to see where a stage's
time went.

Each measure is a function of the running context, listed in `MEASURES` with its table row
(key, what, target): a measure that needs guests running across a restart (every agent
reconnected) or clones right after a snapshot adds a function and a row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.e2e import forget_pools  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

CACHE = Path(os.environ.get("SANDBOX_TEST_CACHE", "/var/tmp/agentic-sandbox-test-cache"))
RECIPE = "debian-12-agent"
# instance ids: bench-…, after $SANDBOX_TEST_NAME_PREFIX when set (runs sharing a libvirtd)
P = os.environ.get("SANDBOX_TEST_NAME_PREFIX", "") + "bench-"


def fmt_load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


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


def op_seconds(op: dict[str, Any]) -> float:
    """An operation's own time, from its accepting to its end (its record's timestamps): the
    poll in `wait_op` sees the end only up to 0.2 s late, which hid differences below that."""
    created = dt.datetime.fromisoformat(op["created_at"])
    return (dt.datetime.fromisoformat(op["updated_at"]) - created).total_seconds()


def create(srv: ServerProcess, body: dict[str, Any], limit: float = 600) -> tuple[float, dict]:
    status, op = srv.api("POST", "/api/v2/admin/instances", body)
    if status != 202:
        raise SystemExit(f"create refused: {status} {op}")
    op = wait_op(srv, op, limit)
    return op_seconds(op), {s["name"]: s["seconds"] or 0.0 for s in op["stages"]}


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


@dataclass
class Bench:
    srv: ServerProcess
    args: argparse.Namespace
    results: dict[str, Any] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)


def measure_restarts(b: Bench) -> None:
    """Server start → ready: the first start of a data directory probes KVM; a restart reuses
    the remembered answer (and probes again in the background)."""
    b.srv.stop()
    started = time.monotonic()
    b.srv.start()
    b.srv.wait_ready()
    b.results["server_first_start"] = {"seconds": round(time.monotonic() - started, 3)}
    runs = []
    for _ in range(b.args.restarts):
        b.srv.stop()
        started = time.monotonic()
        b.srv.start()
        b.srv.wait_ready()
        runs.append((time.monotonic() - started, {}))
    if runs:
        b.results["server_restart"] = summarize(runs)


def measure_images(b: Bench) -> None:
    started = time.monotonic()
    op = wait_op(b.srv, b.srv.ok("POST", "/api/v2/admin/images", {"recipe": RECIPE}), 1800)
    b.results["image_build"] = {
        "seconds": round(time.monotonic() - started, 3),
        "cached": op["result"]["cached"],
    }
    started = time.monotonic()
    op = wait_op(b.srv, b.srv.ok("POST", "/api/v2/admin/images", {"recipe": RECIPE}), 60)
    b.results["image_reuse"] = {
        "seconds": round(time.monotonic() - started, 3),
        "cached": op["result"]["cached"],
    }


def measure_cold(b: Bench) -> None:
    b.made.append(f"{P}cold")
    b.results["cold"] = summarize(
        [create(b.srv, {"id": f"{P}cold", "image": RECIPE, "from_pool": False})]
    )


def measure_from_snapshot(b: Bench) -> None:
    """Clones from a memory snapshot: the first one right after the snapshot is taken (its
    source is being restored and re-connecting at the same moment) apart from later ones."""
    b.srv.ok(
        "POST", f"/api/v2/admin/instances/{P}cold/snapshots", {"name": "golden", "memory": True}
    )
    snaps = []
    for i in range(b.args.snapshots):
        iid = f"{P}snap-{i}"
        b.made.append(iid)
        snaps.append(create(b.srv, {"id": iid, "from_snapshot": f"{P}cold/golden"}, 180))
        if i >= KEEP_CLONES:  # the first ones stay up for the restart measure
            b.srv.ok("DELETE", f"/api/v2/admin/instances/{iid}")
            b.made.remove(iid)
    if snaps:
        b.results["from_snapshot_first"] = summarize(snaps[:1])
    if len(snaps) > 1:
        b.results["from_snapshot_later"] = summarize(snaps[1:])


def measure_agents_after_restart(b: Bench) -> None:
    """A server restart with guests running (the cold one and the kept clones): server
    start → ready, and → every agent connected again (they come back through their guest
    forwards, whose pipes the gateway answers with a TLS alert)."""
    guests = [iid for iid in b.made if iid == f"{P}cold" or iid.startswith(f"{P}snap-")]
    runs, ready_runs = [], []
    for _ in range(b.args.agent_restarts):
        for iid in guests:
            wait_agent(b.srv, iid, 120)
        b.srv.stop()
        started = time.monotonic()
        b.srv.start()
        b.srv.wait_ready()
        ready_at = time.monotonic()
        for iid in guests:
            wait_agent(b.srv, iid, 120, since=started)
        done = time.monotonic()
        ready_runs.append((ready_at - started, {}))
        runs.append((done - ready_at, {}))
    if runs:
        b.results["agents_after_restart"] = {**summarize(runs), "guests": len(guests)}
        b.results["restart_with_guests"] = summarize(ready_runs)


def wait_agent(srv: ServerProcess, iid: str, limit: float, since: float | None = None) -> None:
    """Until the instance's agent is connected (after `since`, a time.monotonic())."""
    wall_since = None if since is None else time.time() - (time.monotonic() - since)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        status, agent = srv.api("GET", f"/api/v2/admin/agents/{iid}")
        if status == 200 and agent.get("state") == "connected":
            at = agent.get("connected_at")
            if wall_since is None or (at and _ts(at) >= wall_since):
                return
        time.sleep(0.05)
    raise SystemExit(f"the agent of {iid} did not connect within {limit}s")


def _ts(value: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(value).timestamp()


def measure_pool(b: Bench) -> None:
    if not b.args.pool:
        return
    srv = b.srv
    pool_op = srv.ok(
        "POST", "/api/v2/admin/pools", {"image": RECIPE, "loadout": "minimal", "size": 1}
    )
    wait_op(srv, pool_op, 900)
    pooled = []
    for i in range(b.args.pool):
        deadline = time.monotonic() + 300
        while srv.ok("GET", "/api/v2/admin/pools")["items"][0]["ready"] < 1:
            if time.monotonic() > deadline:
                raise SystemExit("the pool did not refill")
            time.sleep(0.5)
        if b.args.pool_age:  # a member that has waited (its forward's pipe sat idle)
            time.sleep(b.args.pool_age)
        iid = f"{P}pool-{i}"
        b.made.append(iid)
        pooled.append(create(srv, {"id": iid, "image": RECIPE, "from_pool": True}, 180))
        if b.args.logs is not None:  # a taken member's own journal: its hand-off
            save_agent_log(b, iid, b.args.logs)
        srv.ok("DELETE", f"/api/v2/admin/instances/{iid}")
        b.made.remove(iid)
    b.results["from_pool"] = {**summarize(pooled), "member_age_seconds": b.args.pool_age}
    for pool in srv.ok("GET", "/api/v2/admin/pools")["items"]:
        srv.ok("DELETE", f"/api/v2/admin/pools/{pool['key']}")


# The measures in the order they run, and the table's rows: (key, what, target seconds).
KEEP_CLONES = 2  # clones from the snapshot kept running for the restart measure

MEASURES: list[Callable[[Bench], None]] = [
    measure_restarts,
    measure_images,
    measure_cold,
    measure_from_snapshot,
    measure_agents_after_restart,
    measure_pool,
]
ROWS: list[tuple[str, str, float | None]] = [
    ("server_first_start", "server first start → ready (KVM probe)", None),
    ("server_restart", "server restart → ready", 2.0),
    ("image_build", "image build (or the cached one)", None),
    ("image_reuse", "image reuse", 2.0),
    ("cold", "cold create → agent ready", 60.0),
    ("from_snapshot_first", "first clone right after a memory snapshot", 2.0),
    ("from_snapshot_later", "later clones from the snapshot", 2.0),
    ("restart_with_guests", "server restart → ready, guests running", 2.0),
    ("agents_after_restart", "ready → every agent reconnected", 3.0),
    ("from_pool", "from the warm pool", 1.0),
]


def save_logs(b: Bench, into: Path) -> None:
    """Each guest's agent journal (read through exec) and the server's log, into `into`."""
    into.mkdir(parents=True, exist_ok=True)  # the server's log too when no guest is left
    for iid in b.made:
        save_agent_log(b, iid, into)
    shutil.copyfile(b.srv.log_path, into / "server.log")
    print(f"logs in {into}")


def save_agent_log(b: Bench, iid: str, into: Path) -> None:
    """One guest's agent journal, read through exec, into `into`/<id>.agent.log."""
    into.mkdir(parents=True, exist_ok=True)
    argv = [
        "journalctl",
        "--merge",
        "--no-pager",
        "-o",
        "short-precise",
        "-u",
        "agentic-sandbox-agent",
    ]
    status, answer = b.srv.api(
        "POST",
        f"/api/v2/admin/instances/{iid}/exec",
        {"argv": argv, "budget": {"timeout_seconds": 30}},
    )
    text = answer["stdout"]["data"] if status == 200 else f"exec: {status} {answer}\n"
    (into / f"{iid}.agent.log").write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=3, help="server restarts to time")
    ap.add_argument("--snapshots", type=int, default=3, help="clones from a memory snapshot")
    ap.add_argument("--pool", type=int, default=3, help="creates from the warm pool")
    ap.add_argument(
        "--pool-age", type=float, default=0.0, help="seconds a pool member waits before it is taken"
    )
    ap.add_argument(
        "--agent-restarts", type=int, default=3, help="server restarts with guests running"
    )
    ap.add_argument("--logs", type=Path, help="keep the agents' journals and the server's log here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (libvirt qemu:///system)")
    data = Path(tempfile.mkdtemp(prefix="sbx-bench-", dir="/var/tmp"))
    data.chmod(0o755)
    srv = ServerProcess(
        data / "data",
        env={  # the KVM probe as users get it (on): the restart measure is about it
            "SANDBOX_LIBVIRT_URI": "qemu:///system",
            "SANDBOX_IMAGES_DIR": str(CACHE),
            "SANDBOX_AGENT_HEARTBEAT_SECONDS": "2",
        },
    )
    (data / "data").chmod(0o755)
    load_start = os.getloadavg()
    srv.start()
    b = Bench(srv, args)
    try:
        for measure in MEASURES:
            measure(b)
    finally:
        if args.logs is not None and srv.alive():
            save_logs(b, args.logs)
        for iid in b.made:
            srv.api("DELETE", f"/api/v2/admin/instances/{iid}")
        if srv.alive():
            status, pools = srv.api("GET", "/api/v2/admin/pools")
            for pool in pools.get("items", []) if status == 200 else []:
                srv.api("DELETE", f"/api/v2/admin/pools/{pool['key']}")
        srv.stop()
        forget_pools(data / "data")
        shutil.rmtree(data, ignore_errors=True)

    results = b.results
    results["load_average"] = {"start": load_start, "end": os.getloadavg()}
    print(f"load average: start {fmt_load(load_start)}, end {fmt_load(os.getloadavg())}")
    print(f"\n{'measure':<46}{'p50 s':>9}{'max s':>9}{'target s':>10}  stages (p50 s)")
    for key, what, tgt in ROWS:
        r = results.get(key)
        if r is None:
            continue
        p50 = r.get("p50_seconds", r.get("seconds"))
        mx = r.get("max_seconds", p50)
        stages = " ".join(f"{k}={v}" for k, v in r.get("stages_p50", {}).items())
        print(f"{what:<46}{p50:>9.2f}{mx:>9.2f}{(f'{tgt:.1f}' if tgt else '-'):>10}  {stages}")
    targets = {key: tgt for key, _, tgt in ROWS if tgt is not None}
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
