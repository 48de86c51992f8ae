"""Egress benchmark: HTTPS through the egress proxy (a host agent's listener → the agent link →
the server's proxy → the destination) beside a direct connection from this host to the same
destination, interleaved round by round.

Run: ``.venv/bin/python tests/bench/bench_egress.py [--rounds N] [--quick]`` as root (it makes
a network namespace with an HTTPS server of its own; nothing else is contacted). Prints a table
and writes ``bench-results/egress.json``.

Reported: connection set-up (TCP + CONNECT + TLS handshake + a small GET) p50/p99 both ways
and the ratio; throughput of a 64 MiB HTTPS download both ways (MB/s) and the ratio; CPU of
server + agent per proxied connection and per proxied GB (from /proc); the load average at
start and end (the machine is shared: read absolute times with it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import socket
import ssl
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
from tests.support.measure import cpu_seconds, pct  # noqa: E402
from tests.support.netns import NamespaceHost, make_cert  # noqa: E402
from tests.support.server import ServerProcess, free_port  # noqa: E402

NAME = "bench.egress.test"
PORT = 8443
DOWNLOAD = 64 * 1024 * 1024


class Paths:
    def __init__(self, ctx: ssl.SSLContext, address: str, proxy_port: int) -> None:
        self.ctx = ctx
        self.address = address
        self.proxy_port = proxy_port

    def get(self, proxied: bool, path: str) -> int:
        """One fresh HTTPS connection and one GET; the body's length."""
        if proxied:  # CONNECT through the agent's listener, TLS to the name inside it
            conn = http.client.HTTPSConnection(
                "127.0.0.1", self.proxy_port, context=self.ctx, timeout=60
            )
            conn.set_tunnel(NAME, PORT)
        else:  # to the address the proxy resolves the name to, TLS checked for the name
            conn = http.client.HTTPSConnection(NAME, PORT, context=self.ctx, timeout=60)
            sock = socket.create_connection((self.address, PORT), timeout=60)
            conn.sock = self.ctx.wrap_socket(sock, server_hostname=NAME)
        conn.request("GET", path)
        resp = conn.getresponse()
        n = 0
        while chunk := resp.read(1 << 20):
            n += len(chunk)
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"{'proxied' if proxied else 'direct'} GET {path}: {resp.status}")
        return n


def setup_times(paths: Paths, rounds: int, pids: list[int]) -> dict[str, Any]:
    for _ in range(5):
        paths.get(True, "/warm")
        paths.get(False, "/warm")
    proxied: list[float] = []
    direct: list[float] = []
    cpu = 0.0
    for _ in range(rounds):
        before = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        paths.get(True, "/small")
        proxied.append((time.perf_counter() - t0) * 1000)
        cpu += sum(cpu_seconds(p) for p in pids) - before
        t0 = time.perf_counter()
        paths.get(False, "/small")
        direct.append((time.perf_counter() - t0) * 1000)
    p50p, p50d = statistics.median(proxied), statistics.median(direct)
    return {
        "rounds": rounds,
        "proxied_ms": {"p50": round(p50p, 3), "p99": round(pct(proxied, 99), 3)},
        "direct_ms": {"p50": round(p50d, 3), "p99": round(pct(direct, 99), 3)},
        "ratio_p50": round(p50p / p50d, 2),
        "cpu_ms_per_connection_server_agent": round(cpu / rounds * 1000, 3),
    }


def throughput(paths: Paths, rounds: int, pids: list[int]) -> dict[str, Any]:
    proxied: list[float] = []
    direct: list[float] = []
    cpu = 0.0
    for _ in range(rounds):
        before = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        assert paths.get(True, f"/bytes/{DOWNLOAD}") == DOWNLOAD
        proxied.append(DOWNLOAD / (time.perf_counter() - t0) / 1e6)
        cpu += sum(cpu_seconds(p) for p in pids) - before
        t0 = time.perf_counter()
        assert paths.get(False, f"/bytes/{DOWNLOAD}") == DOWNLOAD
        direct.append(DOWNLOAD / (time.perf_counter() - t0) / 1e6)
    mp, md = statistics.median(proxied), statistics.median(direct)
    return {
        "rounds": rounds,
        "bytes": DOWNLOAD,
        "proxied_mb_per_s": round(mp, 1),
        "direct_mb_per_s": round(md, 1),
        "ratio": round(mp / md, 3),
        "cpu_s_per_gb_server_agent": round(cpu / (rounds * DOWNLOAD / 1e9), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="20 set-up rounds, 2 downloads")
    args = ap.parse_args()
    rounds = 20 if args.quick else max(5, min(args.rounds, 1000))
    downloads = 2 if args.quick else 4
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-egress-"))
    ca, cert, key = make_cert(tmp, NAME)
    ctx = ssl.create_default_context(cafile=str(ca))
    results: dict[str, Any] = {}
    with NamespaceHost("bench") as host:
        host.serve_https(PORT, cert, key, "bench")
        hosts = tmp / "hosts"
        hosts.write_text(f"{host.address} {NAME}\n")
        server = ServerProcess(
            tmp / "server", env={**TEST_SERVER_ENV, "SANDBOX_EGRESS_HOSTS_FILE": str(hosts)}
        ).start()
        try:
            port = free_port()
            agent = start_agent(
                server, "bench-egress", tmp, extra_args=["--egress-listen", f"127.0.0.1:{port}"]
            )
            assert agent.proc is not None
            server.ok(
                "PUT",
                "/api/v2/admin/instances/bench-egress/egress",
                {"network": "allowlist", "allow": [f"{NAME}:{PORT}", f"{host.address}:{PORT}"]},
            )
            pids = [server.pid, agent.worker_pid()]
            paths = Paths(ctx, host.address, port)
            results["setup"] = setup_times(paths, rounds, pids)
            results["throughput"] = throughput(paths, downloads, pids)
            agent.stop()
        finally:
            server.stop()
    results["machine"] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load_start],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    st, tp, mach = results["setup"], results["throughput"], results["machine"]
    rows = [
        (
            "HTTPS set-up + small GET, proxied p50 / p99",
            f"{st['proxied_ms']['p50']} / {st['proxied_ms']['p99']} ms",
        ),
        ("  direct p50 / p99", f"{st['direct_ms']['p50']} / {st['direct_ms']['p99']} ms"),
        ("  ratio (p50)", f"x{st['ratio_p50']}"),
        (
            "  CPU per proxied connection (server+agent)",
            f"{st['cpu_ms_per_connection_server_agent']} ms",
        ),
        (
            f"HTTPS download {DOWNLOAD >> 20} MiB, proxied / direct",
            f"{tp['proxied_mb_per_s']} / {tp['direct_mb_per_s']} MB/s (x{tp['ratio']})",
        ),
        ("  CPU per proxied GB (server+agent)", f"{tp['cpu_s_per_gb_server_agent']} s"),
        ("load average start -> end", f"{mach['loadavg_at_start']} -> {mach['loadavg_at_end']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"egress benchmark ({rounds} interleaved set-up rounds, {downloads} downloads each way)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "egress.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'egress.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
