"""Files benchmark: upload and download through `…/instances/{id}/files` on a host agent beside
a local copy of the same file (`shutil.copyfile`), interleaved round by round.

Run: ``.venv/bin/python tests/bench/bench_files.py [--size-mib N] [--rounds N] [--quick]``.
Prints a table and writes ``bench-results/files.json``. Everything is on loopback: a real
`sandbox-server` subprocess, a real `agent-client` (gRPC over mutual TLS), and this process as
the HTTP client (http.client, 1 MiB blocks, the body streamed from and to disk). Bounded in
count and size.

Reported per direction: MB/s (median of the rounds) and CPU seconds per GB of the server +
agent + this client (from /proc and `os.times`) beside the local copy's MB/s and CPU s/GB (the
upload includes the agent's fsync and rename; the local copy is fsynced too, so both end on
disk). Targets (issue 13): >= 100 MB/s to a host agent. The load average at start and end is
printed (the machine is shared: read absolute numbers with it).

Keystroke during transfer: an interactive session (`cat` in a PTY on the same agent, attached
over the WebSocket) is typed into while one more upload and one more download run; the echo
times (p50/p95/max) are reported beside those of the idle session (the link's fairness: a
keystroke waits behind at most one bulk frame).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import http.client
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.agents import start_agent  # noqa: E402
from tests.support.fixtures import TEST_SERVER_ENV  # noqa: E402
from tests.support.measure import cpu_seconds, own_cpu  # noqa: E402
from tests.support.ptyclient import PtyClient  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402
from tests.support.sessions import create_session  # noqa: E402

MiB = 1024 * 1024
BLOCK = MiB


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


def upload(server: ServerProcess, iid: str, local: Path, remote: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=600, blocksize=BLOCK)
    query = urllib.parse.urlencode({"path": remote})
    with local.open("rb") as body:
        conn.request(
            "PUT",
            f"/api/v2/admin/instances/{iid}/files?{query}",
            body=body,
            headers={
                "Authorization": f"Bearer {server.admin_token}",
                "Content-Length": str(local.stat().st_size),
            },
        )
        resp = conn.getresponse()
        data = resp.read()
    conn.close()
    if resp.status != 201:
        raise RuntimeError(f"upload answered {resp.status}: {data[:500]!r}")
    out: dict[str, Any] = json.loads(data)
    return out


def download(server: ServerProcess, iid: str, remote: str, local: Path) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=600)
    query = urllib.parse.urlencode({"path": remote})
    conn.request(
        "GET",
        f"/api/v2/admin/instances/{iid}/files?{query}",
        headers={"Authorization": f"Bearer {server.admin_token}"},
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"download answered {resp.status}: {resp.read()[:500]!r}")
    total = 0
    with local.open("wb") as f:
        while data := resp.read(BLOCK):
            f.write(data)
            total += len(data)
        f.flush()
        os.fsync(f.fileno())
    conn.close()
    return total


def local_copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_KEYS = 2000  # keystrokes typed during one transfer, at most


async def _echo(ctl: PtyClient, key: str) -> float:
    t0 = time.perf_counter()
    await ctl.send_input(f"{key}\r".encode())
    await ctl.wait_output(key.encode(), timeout=60)
    return time.perf_counter() - t0


async def _keystrokes(
    server: ServerProcess, sid: str, transfers: dict[str, Callable[[], object]]
) -> dict[str, list[float]]:
    """Echo times of the idle session, then of keystrokes typed while each transfer runs
    (in a thread; only echoes that came back while it still ran count)."""
    out: dict[str, list[float]] = {}
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        out["idle"] = [await _echo(ctl, f"idle-{i}") for i in range(20)]
        for name, work in transfers.items():
            thread = threading.Thread(target=work, name=name, daemon=True)
            thread.start()
            times: list[float] = []
            n = 0
            while thread.is_alive() and n < MAX_KEYS:
                took = await _echo(ctl, f"{name}-{n:05d}")
                n += 1
                if thread.is_alive():
                    times.append(took)
                if len(ctl.data) > 1 << 20:  # the search for the echo stays short
                    ctl.data.clear()
            await asyncio.to_thread(thread.join, 600)
            out[name] = times
    return out


def latency(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    q = sorted(xs)
    return {
        "n": len(q),
        "p50_ms": round(statistics.median(q) * 1000, 2),
        "p95_ms": round(q[min(len(q) - 1, int(0.95 * len(q)))] * 1000, 2),
        "max_ms": round(q[-1] * 1000, 2),
    }


def summary(size: int, runs: list[Measure]) -> dict[str, Any]:
    mbps = [size / m.seconds / 1e6 for m in runs]
    cpu = [m.cpu / (size / 1e9) for m in runs]
    return {
        "mb_per_s": round(statistics.median(mbps), 1),
        "mb_per_s_each": [round(x, 1) for x in mbps],
        "cpu_s_per_gb": round(statistics.median(cpu), 2),
    }


def _fmt(lat: dict[str, Any]) -> str:
    if not lat["n"]:
        return "none measured"
    return f"p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms, max {lat['max_ms']} ms (n={lat['n']})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds")
    args = ap.parse_args()
    size_mib = 64 if args.quick else max(8, min(args.size_mib, 2048))
    rounds = 2 if args.quick else max(1, min(args.rounds, 10))
    size = size_mib * MiB
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-files-", dir="/var/tmp"))
    server = ServerProcess(tmp / "server", env=dict(TEST_SERVER_ENV)).start()
    results: dict[str, Any] = {"size_bytes": size, "rounds": rounds}
    try:
        agent = start_agent(server, "bench-files", tmp)
        assert agent.proc is not None
        pids = [server.pid, agent.worker_pid()]
        src = tmp / "source.bin"
        digest = hashlib.sha256()
        with src.open("wb") as f:
            block = os.urandom(MiB)
            for i in range(size_mib):
                chunk = block[i % 13 :] + block[: i % 13]
                digest.update(chunk)
                f.write(chunk)
        remote = str(tmp / "remote.bin")
        ups: list[Measure] = []
        downs: list[Measure] = []
        copies: list[Measure] = []
        upload(server, "bench-files", src, remote)  # warm up
        for r in range(rounds):  # interleaved: upload, download, local copy
            with Measure(pids) as m:
                out = upload(server, "bench-files", src, remote)
            assert out["sha256"] == digest.hexdigest(), out
            ups.append(m)
            back = tmp / f"back-{r}.bin"
            with Measure(pids) as m:
                got = download(server, "bench-files", remote, back)
            assert got == size
            downs.append(m)
            back.unlink()
            with Measure([]) as m:
                local_copy(src, tmp / "copy.bin")
            copies.append(m)
            (tmp / "copy.bin").unlink()
        results["upload"] = summary(size, ups)
        results["download"] = summary(size, downs)
        results["local_copy"] = summary(size, copies)
        sid = create_session(server, "bench-files", ["cat"])
        keys = asyncio.run(
            _keystrokes(
                server,
                sid,
                {
                    "upload": lambda: upload(server, "bench-files", src, remote),
                    "download": lambda: download(server, "bench-files", remote, tmp / "keys.bin"),
                },
            )
        )
        results["keystroke_echo"] = {name: latency(xs) for name, xs in keys.items()}
        server.api("POST", f"/api/v2/admin/sessions/{sid}/kill", {})
        agent.stop()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["target_mb_per_s_host_agent"] = 100
    results["machine"] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load_start],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    up, down, cp, mach = (
        results["upload"],
        results["download"],
        results["local_copy"],
        results["machine"],
    )
    rows = [
        ("upload (server+agent+client)", f"{up['mb_per_s']} MB/s, {up['cpu_s_per_gb']} CPU s/GB"),
        (
            "download (server+agent+client)",
            f"{down['mb_per_s']} MB/s, {down['cpu_s_per_gb']} CPU s/GB",
        ),
        ("local copy + fsync (baseline)", f"{cp['mb_per_s']} MB/s, {cp['cpu_s_per_gb']} CPU s/GB"),
        (
            "upload / download vs local copy",
            f"x{round(up['mb_per_s'] / cp['mb_per_s'], 2)} / "
            f"x{round(down['mb_per_s'] / cp['mb_per_s'], 2)}",
        ),
        ("target (host agent)", ">= 100 MB/s"),
        *(
            (f"keystroke echo, {name}", _fmt(lat))
            for name, lat in results["keystroke_echo"].items()
        ),
        ("load average start -> end", f"{mach['loadavg_at_start']} -> {mach['loadavg_at_end']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"files benchmark ({rounds} interleaved rounds of {size_mib} MiB)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "files.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out_dir / 'files.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
