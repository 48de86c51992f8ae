"""Ports benchmark: HTTP through the reverse proxy (`…/instances/{id}/ports/{port}/…`, over a
host agent's link) beside the same requests sent directly to the loopback server, interleaved
round by round.

Run: ``.venv/bin/python tests/bench/bench_ports.py [--requests N] [--size-mib N] [--rounds N]
[--quick]``. Prints a table and writes ``bench-results/ports.json``. Everything is on loopback:
a real `sandbox-server` subprocess, a real `agent-client` (gRPC over mutual TLS), the upstream
(`tests/support/upstream.py`, an aiohttp server in a thread of this process) and this process
as the client (http.client; one keep-alive connection to the server or to the upstream).
Bounded in count and size.

Reported: small requests (`GET /hello`) per second and CPU milliseconds per request, and a bulk
answer (`GET /bytes?n=…`) in MB/s and CPU seconds per GB — CPU of the server + agent + this
process (client and upstream) from /proc and `os.times` — proxied and direct, and their ratio.
The load average at start and end is printed (the machine is shared: read absolute numbers
with it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.agents import start_agent  # noqa: E402
from tests.support.fixtures import TEST_SERVER_ENV  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402
from tests.support.upstream import Upstream  # noqa: E402

MiB = 1024 * 1024
BLOCK = MiB
IID = "bench-ports"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Measure:
    """Wall time and CPU (the given pids + this process) of one block of work."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def __enter__(self) -> Measure:
        self.cpu0 = sum(cpu_seconds(p) for p in self.pids) + own_cpu()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = sum(cpu_seconds(p) for p in self.pids) + own_cpu() - self.cpu0


class Target:
    """Where requests go: the proxy (with the token) or the upstream directly."""

    def __init__(self, port: int, prefix: str, token: str | None) -> None:
        self.port = port
        self.prefix = prefix
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600, blocksize=BLOCK)

    def get(self, path: str) -> int:
        self.conn.request("GET", self.prefix + path, headers=self.headers)
        resp = self.conn.getresponse()
        total = 0
        while data := resp.read(BLOCK):
            total += len(data)
        if resp.status != 200:
            raise RuntimeError(f"GET {path} answered {resp.status}")
        return total

    def close(self) -> None:
        self.conn.close()


def small(target: Target, n: int, pids: list[int]) -> Measure:
    with Measure(pids) as m:
        for _ in range(n):
            target.get("/hello")
    return m


def bulk(target: Target, size: int, pids: list[int]) -> Measure:
    with Measure(pids) as m:
        got = target.get(f"/bytes?n={size}")
    assert got == size
    return m


def rate(runs: list[Measure], n: int) -> dict[str, Any]:
    per_s = [n / m.seconds for m in runs]
    cpu_ms = [m.cpu / n * 1000 for m in runs]
    return {
        "requests_per_s": round(statistics.median(per_s), 1),
        "requests_per_s_each": [round(x, 1) for x in per_s],
        "cpu_ms_per_request": round(statistics.median(cpu_ms), 3),
    }


def throughput(runs: list[Measure], size: int) -> dict[str, Any]:
    mbps = [size / m.seconds / 1e6 for m in runs]
    cpu = [m.cpu / (size / 1e9) for m in runs]
    return {
        "mb_per_s": round(statistics.median(mbps), 1),
        "mb_per_s_each": [round(x, 1) for x in mbps],
        "cpu_s_per_gb": round(statistics.median(cpu), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="100 requests, 32 MiB, 2 rounds")
    args = ap.parse_args()
    n = 100 if args.quick else max(10, min(args.requests, 5000))
    size_mib = 32 if args.quick else max(8, min(args.size_mib, 1024))
    rounds = 2 if args.quick else max(1, min(args.rounds, 10))
    size = size_mib * MiB
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ports-", dir="/var/tmp"))
    server = ServerProcess(tmp / "server", env=dict(TEST_SERVER_ENV)).start()
    results: dict[str, Any] = {"requests": n, "size_bytes": size, "rounds": rounds}
    try:
        agent = start_agent(server, IID, tmp)
        assert agent.proc is not None
        pids = [server.pid, agent.worker_pid()]
        with Upstream() as up:
            proxy = Target(
                server.http_port,
                f"/api/v2/admin/instances/{IID}/ports/{up.port}",
                server.admin_token,
            )
            direct = Target(up.port, "", None)
            proxy.get("/hello")  # warm up
            direct.get("/hello")
            runs: dict[str, list[Measure]] = {k: [] for k in ("ps", "ds", "pb", "db")}
            for _ in range(rounds):  # interleaved: proxied, direct; small, then bulk
                runs["ps"].append(small(proxy, n, pids))
                runs["ds"].append(small(direct, n, pids))
                runs["pb"].append(bulk(proxy, size, pids))
                runs["db"].append(bulk(direct, size, pids))
            proxy.close()
            direct.close()
        results["small_proxied"] = rate(runs["ps"], n)
        results["small_direct"] = rate(runs["ds"], n)
        results["bulk_proxied"] = throughput(runs["pb"], size)
        results["bulk_direct"] = throughput(runs["db"], size)
        agent.stop()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["machine"] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load_start],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    ps, ds = results["small_proxied"], results["small_direct"]
    pb, db = results["bulk_proxied"], results["bulk_direct"]
    mach = results["machine"]
    rows = [
        (
            "GET /hello proxied",
            f"{ps['requests_per_s']} req/s, {ps['cpu_ms_per_request']} CPU ms/req",
        ),
        (
            "GET /hello direct",
            f"{ds['requests_per_s']} req/s, {ds['cpu_ms_per_request']} CPU ms/req",
        ),
        (
            "proxied / direct (req/s)",
            f"x{round(ps['requests_per_s'] / ds['requests_per_s'], 3)}",
        ),
        (f"GET {size_mib} MiB proxied", f"{pb['mb_per_s']} MB/s, {pb['cpu_s_per_gb']} CPU s/GB"),
        (f"GET {size_mib} MiB direct", f"{db['mb_per_s']} MB/s, {db['cpu_s_per_gb']} CPU s/GB"),
        ("proxied / direct (MB/s)", f"x{round(pb['mb_per_s'] / db['mb_per_s'], 3)}"),
        ("load average start -> end", f"{mach['loadavg_at_start']} -> {mach['loadavg_at_end']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"ports benchmark ({rounds} interleaved rounds: {n} requests, {size_mib} MiB)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "ports.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out_dir / 'ports.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
