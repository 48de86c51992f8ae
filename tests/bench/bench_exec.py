"""Exec benchmark: the round trip of `POST /api/v2/admin/instances/{id}/exec` on a host agent
beside a direct local `subprocess.run` of the same command, interleaved round by round.

Run: ``.venv/bin/python tests/bench/bench_exec.py [--rounds N] [--quick]``. Prints a table and
writes ``bench-results/exec.json``. Everything is on loopback: a real `sandbox-server`
subprocess, a real `agent-client` (gRPC over mutual TLS; each run in its own cgroups when
root), and this process as the HTTP client (one keep-alive connection). Bounded in count.

Pinned (unless ``--no-pin``): the server and the agent, with the agent's runs, on CPU 0; this
client, with its direct runs, on CPU 1.

Reported: p50/p99 of both, what exec adds (target: <= +5 ms p50), the ratio, CPU per exec of
server + agent (from /proc, over the whole loop, so the writes an exec leaves behind count)
beside the CPU of the direct run (this process's children), the stream throughput of one
exec's stdout through the link (MB/s), and the load average at start and end (the machine is
shared: read absolute times with it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
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

from tests.support.agents import start_agent  # noqa: E402
from tests.support.fixtures import TEST_SERVER_ENV  # noqa: E402
from tests.support.measure import cpu_seconds, pct, pin_tree  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

COMMAND = ["echo", "hello"]
FLOOD_BYTES = 256 * 1024 * 1024


class Client:
    def __init__(self, server: ServerProcess, instance_id: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=600)
        self.path = f"/api/v2/admin/instances/{instance_id}/exec"
        self.headers = {
            "Authorization": f"Bearer {server.admin_token}",
            "Content-Type": "application/json",
        }

    def exec(self, body: dict[str, Any]) -> dict[str, Any]:
        self.conn.request("POST", self.path, json.dumps(body), self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"exec answered {resp.status}: {data[:500]!r}")
        out: dict[str, Any] = json.loads(data)
        return out


def round_trip(client: Client, rounds: int, pids: list[int]) -> dict[str, Any]:
    body = {"argv": COMMAND}
    for _ in range(10):  # warm up both paths
        client.exec(body)
        subprocess.run(COMMAND, capture_output=True, check=True)
    via_exec: list[float] = []
    direct: list[float] = []
    direct_cpu = 0.0
    enforcement = ""
    # The server's and agent's CPU over the whole loop, not inside each request: what an exec
    # leaves to do after its answer (the write-behind commit of its audit entry and event)
    # is its cost too. Between requests (the direct runs) they are otherwise idle.
    start = [cpu_seconds(p) for p in pids]
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = client.exec(body)
        via_exec.append((time.perf_counter() - t0) * 1000)
        assert out["stdout"]["data"] == "hello\n" and out["exit_code"] == 0
        enforcement = out["enforcement"]
        c0 = os.times()
        t0 = time.perf_counter()
        subprocess.run(COMMAND, capture_output=True, check=True)
        direct.append((time.perf_counter() - t0) * 1000)
        c1 = os.times()
        direct_cpu += (c1.children_user - c0.children_user) + (
            c1.children_system - c0.children_system
        )
        direct_cpu += (c1.user - c0.user) + (c1.system - c0.system)
    time.sleep(0.2)  # the last exec's writes
    exec_cpu = [cpu_seconds(p) - s for p, s in zip(pids, start, strict=True)]
    p50e, p50d = statistics.median(via_exec), statistics.median(direct)
    return {
        "command": COMMAND,
        "rounds": rounds,
        "enforcement": enforcement,
        "exec_ms": {"p50": round(p50e, 3), "p99": round(pct(via_exec, 99), 3)},
        "direct_ms": {"p50": round(p50d, 3), "p99": round(pct(direct, 99), 3)},
        "added_p50_ms": round(p50e - p50d, 3),
        "ratio_p50": round(p50e / p50d, 2),
        "cpu_ms_per_exec_server_agent": round(sum(exec_cpu) / rounds * 1000, 3),
        "cpu_ms_per_exec_server": round(exec_cpu[0] / rounds * 1000, 3),
        "cpu_ms_per_exec_agent": round(exec_cpu[1] / rounds * 1000, 3),
        "cpu_ms_per_direct_run": round(direct_cpu / rounds * 1000, 3),
        "target_added_p50_ms": 5.0,
    }


def throughput(client: Client, pids: list[int]) -> dict[str, Any]:
    before = sum(cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    out = client.exec(
        {"argv": ["head", "-c", str(FLOOD_BYTES), "/dev/zero"], "stdout_limit_bytes": 0}
    )
    seconds = time.perf_counter() - t0
    cpu = sum(cpu_seconds(p) for p in pids) - before
    assert out["stdout"]["bytes"] == FLOOD_BYTES, out
    return {
        "bytes": FLOOD_BYTES,
        "seconds": round(seconds, 3),
        "mb_per_s": round(FLOOD_BYTES / seconds / 1e6, 1),
        "cpu_s_per_gb_server_agent": round(cpu / (FLOOD_BYTES / 1e9), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="50 rounds")
    ap.add_argument("--no-pin", action="store_true", help="leave the scheduler to place them")
    args = ap.parse_args()
    rounds = 50 if args.quick else max(10, min(args.rounds, 5000))
    pinned = not args.no_pin and (os.cpu_count() or 1) >= 2
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-exec-"))
    if pinned:  # the server and the agent (and the agent's runs) start on CPU 0
        pin_tree({0})
    server = ServerProcess(tmp / "server", env=dict(TEST_SERVER_ENV)).start()
    results: dict[str, Any] = {}
    try:
        agent = start_agent(server, "bench-exec", tmp)
        assert agent.proc is not None
        pids = [server.pid, agent.worker_pid()]
        if pinned:  # this client (and its direct runs) on CPU 1
            pin_tree({1})
        client = Client(server, "bench-exec")
        results["round_trip"] = round_trip(client, rounds, pids)
        results["throughput"] = throughput(client, pids)
        agent.stop()
    finally:
        server.stop()
    results["machine"] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load_start],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "pinned": "server+agent CPU 0, client CPU 1" if pinned else "no",
    }
    rt, tp, mach = results["round_trip"], results["throughput"], results["machine"]
    rows = [
        ("exec round trip p50 / p99", f"{rt['exec_ms']['p50']} / {rt['exec_ms']['p99']} ms"),
        (
            "direct subprocess.run p50 / p99",
            f"{rt['direct_ms']['p50']} / {rt['direct_ms']['p99']} ms",
        ),
        ("exec adds (p50), target <= +5 ms", f"+{rt['added_p50_ms']} ms (x{rt['ratio_p50']})"),
        (
            "CPU per exec: server+agent / direct",
            f"{rt['cpu_ms_per_exec_server_agent']} / {rt['cpu_ms_per_direct_run']} ms",
        ),
        (
            "CPU per exec: server / agent",
            f"{rt['cpu_ms_per_exec_server']} / {rt['cpu_ms_per_exec_agent']} ms",
        ),
        ("enforcement", rt["enforcement"]),
        (
            "one exec's stdout through the link",
            f"{tp['mb_per_s']} MB/s ({tp['cpu_s_per_gb_server_agent']} CPU s/GB)",
        ),
        ("pinned", mach["pinned"]),
        ("load average start -> end", f"{mach['loadavg_at_start']} -> {mach['loadavg_at_end']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"exec benchmark ({rounds} interleaved rounds of {' '.join(COMMAND)!r})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "exec.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'exec.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
