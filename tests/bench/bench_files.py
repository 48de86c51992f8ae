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
import re
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


def measure(
    server: ServerProcess,
    iid: str,
    tmp: Path,
    remote_dir: str,
    pids: list[int],
    size_mib: int,
    rounds: int,
) -> dict[str, Any]:
    """Interleaved rounds (upload, download, local copy) of one `size_mib` file to `iid`, then
    the echo times of a `cat` session on it, idle and during one more upload and download."""
    size = size_mib * MiB
    results: dict[str, Any] = {"size_bytes": size, "rounds": rounds}
    src = tmp / "source.bin"
    digest = hashlib.sha256()
    with src.open("wb") as f:
        block = os.urandom(MiB)
        for i in range(size_mib):
            chunk = block[i % 13 :] + block[: i % 13]
            digest.update(chunk)
            f.write(chunk)
    remote = f"{remote_dir}/remote.bin"
    ups: list[Measure] = []
    downs: list[Measure] = []
    copies: list[Measure] = []
    upload(server, iid, src, remote)  # warm up (and the directory made)
    for r in range(rounds):  # interleaved: upload, download, local copy
        with Measure(pids) as m:
            out = upload(server, iid, src, remote)
        assert out["sha256"] == digest.hexdigest(), out
        ups.append(m)
        back = tmp / f"back-{r}.bin"
        with Measure(pids) as m:
            got = download(server, iid, remote, back)
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
    sid = create_session(server, iid, ["cat"])
    keys = asyncio.run(
        _keystrokes(
            server,
            sid,
            {
                "upload": lambda: upload(server, iid, src, remote),
                "download": lambda: download(server, iid, remote, tmp / "keys.bin"),
            },
        )
    )
    results["keystroke_echo"] = {name: latency(xs) for name, xs in keys.items()}
    server.api("POST", f"/api/v2/admin/sessions/{sid}/kill", {})
    return results


def on_host_agent(tmp: Path, size_mib: int, rounds: int) -> dict[str, Any]:
    server = ServerProcess(tmp / "server", env=dict(TEST_SERVER_ENV)).start()
    try:
        agent = start_agent(server, "bench-files", tmp)
        assert agent.proc is not None
        pids = [server.pid, agent.worker_pid()]
        results = measure(server, "bench-files", tmp, str(tmp), pids, size_mib, rounds)
        agent.stop()
    finally:
        server.stop()
    results["where"] = "host agent"
    results["cpu_of"] = "server+agent+client"
    results["target_mb_per_s"] = 100
    return results


AGENT_CONFIG = "/etc/agentic-sandbox/agent.toml"


def use_transport(srv: ServerProcess, iid: str, transport: str) -> None:
    """Point the guest's agent at the link's virtio-serial port (`serial`, its default) or the
    slirp forward (`forward`: `serial_port = ""`), restart it and wait until it is back — and
    check from its own log that it came back through what was asked."""
    edit = f"sed -i '/^serial_port/d' {AGENT_CONFIG}"
    if transport == "forward":
        edit += f"; echo 'serial_port = \"\"' >> {AGENT_CONFIG}"
    before = srv.ok("GET", f"/api/v2/admin/agents/{iid}").get("connected_at")
    restart = "systemd-run --on-active=1 systemctl restart agentic-sandbox-agent"
    srv.ok(
        "POST",
        f"/api/v2/admin/instances/{iid}/exec",
        {"argv": ["bash", "-c", f"{edit}; {restart}"], "user": "root"},
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        agent = srv.ok("GET", f"/api/v2/admin/agents/{iid}")
        if agent.get("state") == "connected" and agent.get("connected_at") != before:
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"the agent did not come back through the {transport}")
    console = srv.ok("GET", f"/api/v2/admin/instances/{iid}/console?tail=20000")["text"]
    last = re.findall(r"connected to (\S+) as instance", console)[-1]
    via = "serial" if last.startswith("127.0.0.1:") else "forward"
    if via != transport:
        raise SystemExit(f"asked for the {transport}, the agent connected through {last}")


def compare_transports(
    srv: ServerProcess,
    iid: str,
    tmp: Path,
    remote_dir: str,
    pids: list[int],
    size_mib: int,
    rounds: int,
) -> dict[str, Any]:
    """Upload and download through the port and through the forward, in alternating order
    (ABBA) in the same guest, with `measure`'s file: the forward is the in-run baseline."""
    size = size_mib * MiB
    src = tmp / "source.bin"  # `measure`'s
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    runs: dict[str, dict[str, list[Measure]]] = {
        t: {"upload": [], "download": []} for t in ("serial", "forward")
    }
    remote = f"{remote_dir}/compare.bin"
    for r in range(rounds):
        for transport in ("serial", "forward") if r % 2 == 0 else ("forward", "serial"):
            use_transport(srv, iid, transport)
            with Measure(pids) as m:
                out = upload(srv, iid, src, remote)
            assert out["sha256"] == digest, out
            runs[transport]["upload"].append(m)
            with Measure(pids) as m:
                download(srv, iid, remote, tmp / "compare-back.bin")
            runs[transport]["download"].append(m)
    use_transport(srv, iid, "serial")
    return {t: {k: summary(size, v) for k, v in d.items()} for t, d in runs.items()}


#: What a transferred byte costs a guest at the least, measured in the guest on its own vCPU:
#: the agent's SHA-256 (`hashlib`, as `agent/files.py` hashes), the link's TLS 1.3 cipher
#: (ChaCha20-Poly1305: the guest's CPU model has no AES instructions, and gRPC's BoringSSL
#: then prefers it; `openssl speed` is the nearest measure the guest has) and, for an upload, a
#: page-cache write ended by an fsync. One vCPU does them one after another, so an upload can
#: be no faster than 1 / (1/sha + 1/cipher + 1/write) and a download (its file read from the
#: page cache) than 1 / (1/sha + 1/cipher): the in-run ceilings the rates are read against.
GUEST_FLOOR = r"""
import hashlib, json, os, re, subprocess, time
MiB = 1 << 20
block = os.urandom(MiB)
t = time.perf_counter()
h = hashlib.sha256()
for _ in range(32):
    h.update(block)
sha = 32 * MiB / (time.perf_counter() - t)
out = subprocess.run(
    ["openssl", "speed", "-seconds", "2", "-bytes", "262144", "-evp", "chacha20-poly1305"],
    capture_output=True, text=True, check=True,
).stdout
cipher = float(re.findall(r"([0-9.]+)k\s*$", out.strip())[-1]) * 1000
path = "/var/tmp/bench-floor.bin"
t = time.perf_counter()
with open(path, "wb") as f:
    for _ in range(32):
        f.write(block)
    f.flush()
    os.fsync(f.fileno())
write = 32 * MiB / (time.perf_counter() - t)
os.unlink(path)
print(json.dumps({"sha256": sha, "chacha20_poly1305": cipher, "write_fsync": write}))
"""


def guest_floor(srv: ServerProcess, iid: str) -> dict[str, float]:
    """`GUEST_FLOOR` run in the guest: each rate in MB/s, and each direction's ceiling."""
    body = {"argv": ["python3", "-c", GUEST_FLOOR], "budget": {"timeout_seconds": 120}}
    out = srv.ok("POST", f"/api/v2/admin/instances/{iid}/exec", body, timeout=180)
    if out["exit_code"] != 0:
        raise SystemExit(f"the guest's floor measure failed: {out['stderr']['data'][-500:]}")
    rates = {k: v / 1e6 for k, v in json.loads(out["stdout"]["data"]).items()}
    link = 1 / rates["sha256"] + 1 / rates["chacha20_poly1305"]
    rates["ceiling_upload"] = 1 / (link + 1 / rates["write_fsync"])
    rates["ceiling_download"] = 1 / link
    return {k: round(v, 1) for k, v in rates.items()}


def in_guest(
    tmp: Path, size_mib: int, rounds: int, vcpus: int = 1, compare: bool = False
) -> dict[str, Any]:
    """The same measures into a real `isolated` TCG guest (cold boot of the test image, built
    into the test cache when missing) of `vcpus` vCPUs, once cloud-init has finished in it;
    CPU is the server's and QEMU's (the guest's agent runs inside QEMU) and this client's."""
    from tests.support.e2e import (
        NAME_PREFIX,
        RECIPE,
        domains_named,
        libvirt_server,
        provision,
        wait_op,
    )

    iid = f"{NAME_PREFIX}bench-files"
    with libvirt_server("sbx-bench-files-", SANDBOX_PROVISION_READY_TIMEOUT_SECONDS="900") as srv:
        try:
            op = wait_op(srv, srv.ok("POST", "/api/v2/admin/images", {"recipe": RECIPE}), 1800)
            if op["state"] != "succeeded":
                raise SystemExit(f"image build failed: {op.get('error')}")
            body = {"id": iid, "image": RECIPE, "loadout": "minimal", "resources": {"cpus": vcpus}}
            op = provision(srv, body, 1000)
            if op["state"] != "succeeded":
                raise SystemExit(f"create failed: {op.get('error')} {op.get('stages')}")
            inst = srv.ok("GET", f"/api/v2/admin/instances/{iid}")
            (domain,) = domains_named(iid)
            qemu = int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text().strip())
            remote_dir = "/var/tmp/bench-files"
            mkdir = {"argv": ["mkdir", "-p", remote_dir]}
            srv.ok("POST", f"/api/v2/admin/instances/{iid}/exec", mkdir)
            settle: dict[str, Any] = {
                "argv": ["cloud-init", "status", "--wait"],
                "budget": {"timeout_seconds": 900},
            }
            srv.ok("POST", f"/api/v2/admin/instances/{iid}/exec", settle, timeout=930)
            before = guest_floor(srv, iid)
            results = measure(srv, iid, tmp, remote_dir, [srv.pid, qemu], size_mib, rounds)
            results["guest_floor"] = {"before": before, "after": guest_floor(srv, iid)}
            if compare:
                results["transports"] = compare_transports(
                    srv, iid, tmp, remote_dir, [srv.pid, qemu], size_mib, rounds
                )
        finally:
            srv.api("DELETE", f"/api/v2/admin/instances/{iid}")
    results["where"] = f"TCG guest ({inst['network_policy']}, {inst['vcpus']} vCPU)"
    results["target_mb_per_s"] = 20
    results["cpu_of"] = "server+QEMU+client"
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=None, help="256 (a guest: 100)")
    ap.add_argument("--rounds", type=int, default=None, help="3 (a guest: 2)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds")
    ap.add_argument(
        "--guest",
        action="store_true",
        help="into a real isolated TCG guest (needs root and libvirtd) instead of a host agent",
    )
    ap.add_argument("--vcpus", type=int, default=1, help="the guest's vCPUs (--guest; 1)")
    ap.add_argument(
        "--compare-forward",
        action="store_true",
        help="(--guest) also the agent link through the virtio-serial port and through the "
        "slirp forward, alternating rounds in the same guest",
    )
    args = ap.parse_args()
    if args.guest and os.geteuid() != 0:
        raise SystemExit("--guest needs root (libvirt qemu:///system)")
    default_mib, default_rounds = (100, 2) if args.guest else (256, 3)
    size_mib = 64 if args.quick else max(8, min(args.size_mib or default_mib, 2048))
    rounds = 2 if args.quick else max(1, min(args.rounds or default_rounds, 10))
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-files-", dir="/var/tmp"))
    try:
        if args.guest:
            vcpus = max(1, min(args.vcpus, 8))
            results = in_guest(tmp, size_mib, rounds, vcpus, args.compare_forward)
        else:
            results = on_host_agent(tmp, size_mib, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
        (f"upload ({results['cpu_of']})", f"{up['mb_per_s']} MB/s, {up['cpu_s_per_gb']} CPU s/GB"),
        (
            f"download ({results['cpu_of']})",
            f"{down['mb_per_s']} MB/s, {down['cpu_s_per_gb']} CPU s/GB",
        ),
        ("local copy + fsync (baseline)", f"{cp['mb_per_s']} MB/s, {cp['cpu_s_per_gb']} CPU s/GB"),
        (
            "upload / download vs local copy",
            f"x{round(up['mb_per_s'] / cp['mb_per_s'], 2)} / "
            f"x{round(down['mb_per_s'] / cp['mb_per_s'], 2)}",
        ),
        (f"target ({results['where']})", f">= {results['target_mb_per_s']} MB/s"),
        *(
            (
                f"guest's own rates, {when}",
                f"SHA-256 {f['sha256']}, ChaCha20-Poly1305 {f['chacha20_poly1305']}, "
                f"write+fsync {f['write_fsync']} MB/s -> ceilings: upload "
                f"{f['ceiling_upload']} (x{round(up['mb_per_s'] / f['ceiling_upload'], 2)}), "
                f"download {f['ceiling_download']} MB/s "
                f"(x{round(down['mb_per_s'] / f['ceiling_download'], 2)})",
            )
            for when, f in results.get("guest_floor", {}).items()
        ),
        *(
            (f"keystroke echo, {name}", _fmt(lat))
            for name, lat in results["keystroke_echo"].items()
        ),
        *(
            (
                f"{kind} via the {t} (A/B)",
                f"{r[kind]['mb_per_s']} MB/s {r[kind]['mb_per_s_each']}, "
                f"{r[kind]['cpu_s_per_gb']} CPU s/GB",
            )
            for t, r in results.get("transports", {}).items()
            for kind in ("upload", "download")
        ),
        ("load average start -> end", f"{mach['loadavg_at_start']} -> {mach['loadavg_at_end']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"files benchmark, {results['where']} ({rounds} interleaved rounds of {size_mib} MiB)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    out_dir = REPO / "bench-results"
    out_dir.mkdir(exist_ok=True)
    name = "files-guest.json" if args.guest else "files.json"
    (out_dir / name).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
