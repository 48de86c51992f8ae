"""Failover benchmark: leader death → agents reconnected and sessions writable (target <= 5 s).

    .venv/bin/python tests/bench/bench_failover.py [--agents N] [--rounds N]

Two real `sandbox-server` nodes on a private PostgreSQL (started here, `pg-test-cluster.sh`)
and one data dir, pinned to CPU 0; N real host agents (default 5), pinned to CPU 1, each given
both control addresses and holding one session (`while read l; do echo got:$l; done`). Each
round stops the leader and times, from that moment: the follower leading and ready (`/readyz`),
every agent connected to it again, and every session writable through it (a controller
attached to the new leader types a line and the session's process answers it). Rounds
alternate (ABBA) between `kill -9` and the in-run baseline, a graceful stop (SIGTERM: the lock
is released at once and the agents' links end cleanly); the stopped node then comes back as a
follower. Reported per kind: p50/max of each stage, the new leader's CPU over the takeover, and
the load average at start and end. Writes bench-results/failover.json. Bounded: rounds <= 20,
agents <= 50, every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.agents import AgentProcess, enrollment_token, register_host_instance  # noqa: E402
from tests.support.measure import cpu_seconds  # noqa: E402
from tests.support.ptyclient import PtyClient  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402
from tests.support.sessions import create_session  # noqa: E402

WAIT = 60.0
ECHO = ["sh", "-c", "stty -echo; while read l; do echo got:$l; done"]


def readyz(srv: ServerProcess) -> dict[str, Any] | None:
    if not srv.alive():
        return None
    try:
        _, doc = srv.api("GET", "/readyz", timeout=5)
    except OSError:
        return None
    return doc if isinstance(doc, dict) else None


def wait_for(what: str, pred: Any, limit: float = WAIT) -> float:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if pred():
            return time.time()
        time.sleep(0.02)
    raise SystemExit(f"timed out: {what}")


def leads(srv: ServerProcess) -> bool:
    d = readyz(srv)
    return bool(d and d.get("role") == "leader" and d.get("status") == "ready")


def agents_back(srv: ServerProcess, ids: list[str], since: float) -> bool:
    try:
        status, body = srv.api("GET", "/api/v2/admin/agents", timeout=5)
    except OSError:
        return False
    if status != 200:
        return False
    seen = {a["instance_id"]: a for a in body["items"]}
    for i in ids:
        a = seen.get(i)
        if a is None or a["state"] != "connected" or not a.get("connected_at"):
            return False
        if dt.datetime.fromisoformat(a["connected_at"]).timestamp() < since:
            return False
    return True


async def writable(srv: ServerProcess, sids: list[str], tag: str) -> None:
    """Every session answers a line typed through `srv` (retried while its agent is away)."""

    async def one(sid: str) -> None:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                c = await PtyClient.connect(srv.ws_url, sid, srv.admin_token, role="control")
                try:
                    await c.send_input(f"{tag}\n".encode())
                    await c.wait_output(f"got:{tag}".encode(), timeout=5)
                    return
                finally:
                    await c.close()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    await asyncio.gather(*(one(s) for s in sids))


def round_once(
    kind: str, nodes: list[ServerProcess], ids: list[str], sids: list[str], k: int
) -> dict[str, Any]:
    leader = next(n for n in nodes if leads(n))
    follower = next(n for n in nodes if n is not leader)
    cpu0 = cpu_seconds(follower.pid)
    t0 = time.time()
    if kind == "kill9":
        leader.kill9()
    else:
        assert leader.proc is not None
        leader.proc.terminate()
    t_lead = wait_for("the follower leads", lambda: leads(follower))
    t_agents = wait_for("every agent back", lambda: agents_back(follower, ids, t0))
    asyncio.run(writable(follower, sids, f"r{k}"))
    t_write = time.time()
    cpu = cpu_seconds(follower.pid) - cpu0
    if leader.proc is not None:
        leader.proc.wait(30)
    leader.start(WAIT)  # back as a follower
    wait_for("the old leader follows", lambda: (readyz(leader) or {}).get("role") == "follower")
    return {
        "kind": kind,
        "leads_s": round(t_lead - t0, 3),
        "agents_s": round(t_agents - t0, 3),
        "writable_s": round(t_write - t0, 3),
        "leader_cpu_s": round(cpu, 3),
    }


def summary(rounds: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    rs = [r for r in rounds if r["kind"] == kind]
    out: dict[str, Any] = {"rounds": len(rs)}
    for key in ("leads_s", "agents_s", "writable_s", "leader_cpu_s"):
        vals = [r[key] for r in rs]
        out[key] = {"p50": round(statistics.median(vals), 3), "max": round(max(vals), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="even: ABBA kill -9 / SIGTERM")
    args = ap.parse_args()
    n_agents = max(1, min(args.agents, 50))
    n_rounds = max(2, min(args.rounds, 20))
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    tmp.chmod(0o755)  # the postgres user runs the cluster in it
    pg = tmp / "pg"
    url = subprocess.run(
        [str(REPO / "scripts/pg-test-cluster.sh"), "start", str(pg)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    pin = ["taskset", "-c", "0"]
    nodes = [
        ServerProcess(
            tmp / "data",
            env={"SANDBOX_NODE_NAME": name, "SANDBOX_DATABASE_URL": url},
            wrapper=pin,
            log_path=tmp / f"{name}.log",
        )
        for name in ("n1", "n2")
    ]
    agents: list[AgentProcess] = []
    rounds: list[dict[str, Any]] = []
    try:
        for n in nodes:
            n.start(WAIT)
        wait_for("a leader", lambda: any(leads(n) for n in nodes))
        leader = next(n for n in nodes if leads(n))
        servers = ",".join(n.grpc_target for n in nodes)
        enrolls = ",".join(n.enroll_target for n in nodes)
        ids = [f"fo-{i}" for i in range(n_agents)]
        for iid in ids:
            register_host_instance(leader, iid)
            a = AgentProcess(
                leader,
                iid,
                tmp / f"agent-{iid}",
                enrollment_token=enrollment_token(leader, iid),
                extra_args=["--server", servers, "--enroll-server", enrolls],
            ).start()
            assert a.proc is not None
            for pid in (a.proc.pid, a.worker_pid()):  # the keeper and its worker
                os.sched_setaffinity(pid, {1 % (os.cpu_count() or 1)})
            agents.append(a)
        for a in agents:
            a.wait_connected(WAIT)
        sids = [create_session(leader, iid, ECHO) for iid in ids]
        asyncio.run(writable(leader, sids, "warm"))
        kinds = ["kill9", "sigterm", "sigterm", "kill9"]
        for k in range(n_rounds):
            kind = kinds[k % 4]
            r = round_once(kind, nodes, ids, sids, k)
            rounds.append(r)
            print(f"  round {k + 1}: {json.dumps(r)}", flush=True)
    finally:
        for a in agents:
            a.stop()
        for n in nodes:
            n.stop()
        subprocess.run([str(REPO / "scripts/pg-test-cluster.sh"), "stop", str(pg)], check=False)
    results = {
        "agents": n_agents,
        "rounds": rounds,
        "kill9": summary(rounds, "kill9"),
        "sigterm": summary(rounds, "sigterm"),
        "target_writable_s": 5.0,
        "machine": {
            "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_start": [round(x, 2) for x in load_start],
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    k9, st, mach = results["kill9"], results["sigterm"], results["machine"]
    rows = [("measure (p50 / max, seconds)", "kill -9", "graceful stop (baseline)")]
    for key, what in (
        ("leads_s", "follower leads and is ready"),
        ("agents_s", f"all {n_agents} agents connected to it"),
        ("writable_s", "every session writable (target <= 5 s)"),
        ("leader_cpu_s", "new leader's CPU over the takeover"),
    ):
        rows.append(
            (
                what,
                f"{k9[key]['p50']} / {k9[key]['max']}",
                f"{st[key]['p50']} / {st[key]['max']}",
            )
        )
    rows.append(
        ("load average start -> end", f"{mach['loadavg_at_start']}", f"{mach['loadavg_at_end']}")
    )
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    print(f"failover benchmark ({n_rounds} rounds, ABBA, {n_agents} host agents)")
    for a, b, c in rows:
        print(f"  {a:<{w0}}  {b:<{w1}}  {c}")
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "failover.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'failover.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
