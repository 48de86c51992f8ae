"""Session benchmarks: keystroke round trip, throughput, fan-out, stalled observer, Ctrl-C,
1000 agent links.

Run: ``.venv/bin/python tests/bench/bench_sessions.py [--quick] [--only NAME ...]``. Prints a
table and writes ``bench-results/sessions.json``. Everything runs on loopback: a real
`sandbox-server` subprocess, a real `agent-client` (real PTYs, gRPC over mutual TLS), and this
process as the WebSocket clients. Every loop is bounded in count and time.

Benchmarks (targets from the issue):
  keystroke RTT      WS input -> server -> agent -> PTY echo -> server -> WS, p50/p99, beside a
                     direct WS -> PTY program (same framing), same run: server adds <= 2 ms p99
  throughput         one session's output to one observer: >= 50 MB/s
  fan-out 10 / 100   the same flood to N observers: aggregate >= 300 MB/s
  stalled observer   controller echo p99 with a never-reading observer attached moves < 10 %
  redacted           the throughput flood with a secret bound to the instance: text lines that
                     hold a secret's prefix and the whole secret (redaction on the output path)
  ctrl-c             `yes` flood, Ctrl-C -> output stopped (prompt back) within 200 ms
  agent links        1000 simulated agents with heartbeats: server RSS <= 500 MiB, CPU <= 20 %
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from tests.support.agents import start_agent  # noqa: E402
from tests.support.server import ServerProcess, free_port  # noqa: E402

SUBPROTOCOL = "sandbox.pty.v1"
ECHO_CMD = ["sh", "-c", "stty -icanon -opost; exec cat > /dev/null"]
LETTERS = b"abcdefghijklmnopqrstuvwxyz"
RESULTS: dict[str, Any] = {}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(pct(values, 50) * 1000, 3),
        "p99_ms": round(pct(values, 99) * 1000, 3),
        "mean_ms": round(statistics.fmean(values) * 1000, 3),
        "max_ms": round(max(values) * 1000, 3),
    }


# ==================================================================== the baseline program
def baseline_server(port: int) -> None:
    """A direct WebSocket -> PTY relay (no server, no agent, no gRPC), same framing."""
    import fcntl

    import uvloop
    from aiohttp import web
    from ptyprocess import PtyProcess

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), compress=False)
        await ws.prepare(request)
        proc = PtyProcess.spawn(ECHO_CMD, dimensions=(24, 80))
        fd = proc.fd
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        loop = asyncio.get_running_loop()
        offset = 0
        pending: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)

        def readable() -> None:
            nonlocal offset
            try:
                data = os.read(fd, 65536)
            except OSError:
                loop.remove_reader(fd)
                return
            frame = struct.pack(">Q", offset) + data
            offset += len(data)
            pending.put_nowait(frame)

        async def writer() -> None:
            while True:
                await ws.send_bytes(await pending.get())

        loop.add_reader(fd, readable)
        task = asyncio.create_task(writer())
        try:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    os.write(fd, msg.data)
        finally:
            loop.remove_reader(fd)
            task.cancel()
            proc.terminate(force=True)
        return ws

    app = web.Application()
    app.router.add_get("/attach", handler)
    uvloop.run(web._run_app(app, host="127.0.0.1", port=port, print=None))


# ==================================================================== clients
async def ws_connect(
    http: aiohttp.ClientSession, url: str, token: str | None, **params: str
) -> aiohttp.ClientWebSocketResponse:
    protocols = (SUBPROTOCOL, f"bearer.{token}") if token else (SUBPROTOCOL,)
    return await http.ws_connect(
        url, params=params, protocols=protocols, compress=0, max_msg_size=0, autoping=True
    )


async def keystrokes(ws: aiohttp.ClientWebSocketResponse, n: int, warmup: int) -> list[float]:
    """Send one byte at a time; time until its echo comes back."""
    out: list[float] = []
    for i in range(warmup + n):
        ch = LETTERS[i % 26 : i % 26 + 1]
        t0 = time.perf_counter()
        await ws.send_bytes(ch)
        deadline = t0 + 5
        while True:
            msg = await ws.receive(timeout=max(0.01, deadline - time.perf_counter()))
            if msg.type == aiohttp.WSMsgType.BINARY and ch in msg.data[8:]:
                break
            if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                raise RuntimeError(f"connection ended: {msg.type}")
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def create(server: ServerProcess, instance: str, command: list[str], **kw: Any) -> str:
    out = server.ok(
        "POST", "/api/v2/admin/sessions", {"instance_id": instance, "command": command, **kw}
    )
    return str(out["id"])


def attach_url(server: ServerProcess, sid: str) -> str:
    return f"{server.ws_url}/api/v2/admin/sessions/{sid}/attach"


# ==================================================================== benchmarks
async def bench_keystrokes(server: ServerProcess, instance: str, n: int) -> None:
    port = free_port()
    base = subprocess.Popen(
        [sys.executable, __file__, "--baseline-server", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    bws = await ws_connect(http, f"ws://127.0.0.1:{port}/attach", None)
                    break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            else:
                raise RuntimeError("baseline server did not start")
            sid = create(server, instance, ECHO_CMD)
            sws = await ws_connect(
                http, attach_url(server, sid), server.admin_token, role="control"
            )
            await asyncio.sleep(0.3)
            # Interleave rounds so background load hits both alike.
            base_rtt: list[float] = []
            srv_rtt: list[float] = []
            rounds = 5
            for _ in range(rounds):
                base_rtt += await keystrokes(bws, n // rounds, 20)
                srv_rtt += await keystrokes(sws, n // rounds, 20)
            await bws.close()
            await sws.close()
            server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    finally:
        base.terminate()
        base.wait(10)
    b, s = ms(base_rtt), ms(srv_rtt)
    RESULTS["keystroke_rtt"] = {
        "baseline_direct_ws_pty": b,
        "server": s,
        "added_p50_ms": round(s["p50_ms"] - b["p50_ms"], 3),
        "added_p99_ms": round(s["p99_ms"] - b["p99_ms"], 3),
        "ratio_p50": round(s["p50_ms"] / b["p50_ms"], 2),
        "target": "server adds <= 2 ms at p99",
    }


FLOOD_END = b"END-OF-FLOOD"


async def _observer(
    http: aiohttp.ClientSession, url: str, token: str, stats: dict[str, Any]
) -> None:
    ws = await ws_connect(http, url, token, role="observe", **{"from": "0"})
    stats["connected"] = True
    got = 0
    first = None
    tail = b""
    try:
        while True:
            msg = await ws.receive(timeout=120)
            if msg.type == aiohttp.WSMsgType.BINARY:
                payload = msg.data[8:]
                if first is None and payload:
                    first = time.perf_counter()
                got += len(payload)
                if FLOOD_END in tail + payload[-64:]:
                    break
                tail = payload[-16:]
            elif msg.type == aiohttp.WSMsgType.TEXT:
                ctl = json.loads(msg.data)
                if ctl["type"] == "resync" and ctl["reason"] == "behind":
                    stats["resyncs"] = stats.get("resyncs", 0) + 1
                    tail = b""
            else:
                raise RuntimeError(f"observer connection ended: {msg.type}")
    finally:
        stats.update(bytes=got, first=first, last=time.perf_counter())
        await ws.close()


ZERO_FLOOD = "head -c {size} /dev/zero | tr '\\0' x"
REDACT_SECRET = "bench-s3cr3t-0123456789abcdef"
# Every line holds a secret's prefix that fails, and the whole secret (masked).
REDACT_FLOOD = (
    f"yes 'output line with bench-s3cr a prefix and the secret {REDACT_SECRET} in it' "
    "| head -c {size}"
)


async def bench_flood(
    server: ServerProcess,
    instance: str,
    observers: int,
    size: int,
    source: str = ZERO_FLOOD,
) -> dict[str, Any]:
    wait = 1.0 + observers * 0.03
    cmd = [
        "sh",
        "-c",
        f"stty -opost -echo; sleep {wait:.2f}; {source.format(size=size)}; "
        f"printf {FLOOD_END.decode()}; sleep 600",
    ]
    sid = create(server, instance, cmd)
    stats: list[dict[str, Any]] = [{} for _ in range(observers)]
    cpu0 = process_cpu_seconds(server.pid)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [
            asyncio.create_task(_observer(http, attach_url(server, sid), server.admin_token, st))
            for st in stats
        ]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    server_cpu = process_cpu_seconds(server.pid) - cpu0
    server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    total = sum(st["bytes"] for st in stats)
    start = min(st["first"] for st in stats if st["first"])
    end = max(st["last"] for st in stats)
    per = [st["bytes"] / (st["last"] - st["first"]) / 1e6 for st in stats if st["first"]]
    return {
        "observers": observers,
        "flood_bytes": size,
        "aggregate_MB_s": round(total / (end - start) / 1e6, 1),
        "per_observer_MB_s_p50": round(pct(per, 50), 1),
        "seconds": round(end - start, 2),
        "resyncs": sum(st.get("resyncs", 0) for st in stats),
        "delivered_fraction": round(total / (size * observers), 3),
        # the whole flood, session start and observer connects included
        "server_cpu_ms_per_MB": round(server_cpu * 1000 / (size / 1e6), 2),
    }


def bench_redactor(total: int) -> None:
    """The redactor alone, in this process: a flood in 64 KiB chunks (text lines with a
    secret's failing prefix and the whole secret, among 10 bound secrets) and an echo-like
    stream of 1-byte writes."""
    from agentic_sandbox.broker.sessions.redaction import StreamRedactor

    secrets = [REDACT_SECRET] + [f"other-secret-value-{i:02d}-xyz" for i in range(9)]
    line = f"output line with bench-s3cr a prefix and the secret {REDACT_SECRET} in it\n"
    data = (line.encode() * (total // len(line) + 1))[:total]
    out: dict[str, Any] = {"secrets": len(secrets)}
    for name, chunk in (("flood_64KiB_chunks", 64 * 1024), ("keystrokes_1_byte", 1)):
        n = total if chunk > 1 else min(total, 200_000)
        r = StreamRedactor(secrets)
        t0 = time.perf_counter()
        got = 0
        for i in range(0, n, chunk):
            got += len(r.feed(data[i : i + chunk]))
        seconds = time.perf_counter() - t0
        out[name] = {
            "bytes": n,
            "MB_s": round(n / seconds / 1e6, 1),
            "us_per_feed": round(seconds / ((n + chunk - 1) // chunk) * 1e6, 2),
        }
    RESULTS["redactor"] = out


async def bench_stalled(server: ServerProcess, instance: str, n: int) -> None:
    """Two identical sessions, A with a never-reading observer attached, B without; after a
    flood has filled the stalled observer's socket (its writer is blocked), keystroke rounds
    alternate between A's and B's controller so background load hits both alike."""
    from tests.support.sessions import RawWebSocket

    flood = 32 * 1024 * 1024
    cmd = [
        "sh",
        "-c",
        "stty -icanon -opost -echo; read -r go; "
        f"head -c {flood} /dev/zero | tr '\\0' x; printf '\\nFLOOD-DONE\\n'; "
        "stty echo; exec cat > /dev/null",
    ]
    sid_a, sid_b = create(server, instance, cmd), create(server, instance, cmd)
    async with aiohttp.ClientSession() as http:
        ctl_a = await ws_connect(
            http, attach_url(server, sid_a), server.admin_token, role="control"
        )
        ctl_b = await ws_connect(
            http, attach_url(server, sid_b), server.admin_token, role="control"
        )
        stalled = await RawWebSocket.connect(server, sid_a, server.admin_token)
        await asyncio.sleep(0.3)
        for ws in (ctl_a, ctl_b):
            await ws.send_bytes(b"\n")  # the floods start; the stalled observer's socket fills
            deadline = time.monotonic() + 120
            seen = b""
            while b"FLOOD-DONE" not in seen and time.monotonic() < deadline:
                msg = await ws.receive(timeout=60)
                if msg.type == aiohttp.WSMsgType.BINARY:
                    seen = seen[-16:] + msg.data[8:]
        await asyncio.sleep(0.5)
        with_stalled: list[float] = []
        without: list[float] = []
        await keystrokes(ctl_a, 0, 30)
        await keystrokes(ctl_b, 0, 30)
        trials: list[float] = []
        for _ in range(5):
            wa: list[float] = []
            wb: list[float] = []
            for i in range(n // 5):  # alternate keystroke by keystroke (ABBA: no order bias)
                if i % 2:
                    wb += await keystrokes(ctl_b, 1, 0)
                    wa += await keystrokes(ctl_a, 1, 0)
                else:
                    wa += await keystrokes(ctl_a, 1, 0)
                    wb += await keystrokes(ctl_b, 1, 0)
            trials.append(round((pct(wa, 99) / pct(wb, 99) - 1) * 100, 1))
            with_stalled += wa
            without += wb
        members = server.ok("GET", f"/api/v2/admin/sessions/{sid_a}")["members"]
        stalled.close()
        await ctl_a.close()
        await ctl_b.close()
    for sid in (sid_a, sid_b):
        server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    b, a = ms(without), ms(with_stalled)
    RESULTS["stalled_observer"] = {
        "echo_without": b,
        "echo_with_stalled_observer": a,
        "p99_change_pct": round((a["p99_ms"] / b["p99_ms"] - 1) * 100, 1),
        "p50_change_pct": round((a["p50_ms"] / b["p50_ms"] - 1) * 100, 1),
        "p99_change_pct_per_trial": trials,
        "p99_change_pct_median_of_trials": statistics.median(trials),
        "stalled_still_attached": len(members) == 2,
        "target": "p99 moves < 10 %",
    }


async def bench_ctrl_c(server: ServerProcess, instance: str, rounds: int) -> None:
    sid = create(
        server,
        instance,
        ["bash", "--norc", "--noprofile", "-i"],
        env={"PS1": "PROMPT> "},
    )
    lat: list[float] = []
    flood_bytes: list[int] = []
    async with aiohttp.ClientSession() as http:
        ws = await ws_connect(
            http, attach_url(server, sid), server.admin_token, role="control", **{"from": "0"}
        )

        async def until(pred: Any, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                msg = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
                if msg.type == aiohttp.WSMsgType.BINARY:
                    state["buf"] = state["buf"][-64:] + msg.data[8:]
                    state["bytes"] += len(msg.data) - 8

        state: dict[str, Any] = {"buf": b"", "bytes": 0}
        await until(lambda: b"PROMPT> " in state["buf"], 10)
        for _ in range(rounds):
            state.update(buf=b"", bytes=0)
            await ws.send_bytes(b"yes\r")
            await until(lambda: state["bytes"] > 4 * 1024 * 1024, 30)  # flooding for real
            state["buf"] = b""
            t0 = time.perf_counter()
            await ws.send_bytes(b"\x03")
            await until(lambda: b"PROMPT> " in state["buf"], 10)
            lat.append(time.perf_counter() - t0)
            flood_bytes.append(state["bytes"])
            await asyncio.sleep(0.3)
        await ws.close()
    server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    RESULTS["ctrl_c"] = {
        **ms(lat),
        "flood_bytes_seen_p50": int(pct([float(b) for b in flood_bytes], 50)),
        "target": "output stops within 200 ms",
    }


# ---- 1000 agent links ---------------------------------------------------------------------------
async def bench_agent_links(tmp: Path, count: int, window: float) -> None:
    import grpc
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from agentic_sandbox.proto import agent_pb2 as pb
    from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc

    server = ServerProcess(
        tmp / "agents-server",
        env={
            "SANDBOX_RATE_LIMIT_PER_MINUTE": "1000000",
            "SANDBOX_RATE_LIMIT_BURST": "100000",
            "SANDBOX_LOG_LEVEL": "WARNING",
        },
    ).start()
    try:
        t_setup = time.perf_counter()
        ca = server.ca_path.read_bytes()
        ids = [f"sim-{i:04d}" for i in range(count)]
        tokens: dict[str, str] = {}
        headers = {"Authorization": f"Bearer {server.admin_token}"}
        sem = asyncio.Semaphore(16)
        async with aiohttp.ClientSession(headers=headers) as http:

            async def prepare(inst: str) -> None:
                async with sem:
                    async with http.post(
                        server.url + "/api/v2/admin/agents/host-instances",
                        json={"instance_id": inst},
                    ) as r:
                        assert r.status == 201, await r.text()
                    async with http.post(
                        server.url + f"/api/v2/admin/instances/{inst}/enrollment-tokens",
                        json={},
                    ) as r:
                        assert r.status == 201, await r.text()
                        tokens[inst] = (await r.json())["token"]

            await asyncio.gather(*(prepare(i) for i in ids))
        opts = [("grpc.ssl_target_name_override", "agentic-sandbox-server")]
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        identities: dict[str, tuple[bytes, bytes]] = {}
        async with grpc.aio.secure_channel(server.enroll_target, creds, options=opts) as ch:
            stub = pb_grpc.AgentLinkStub(ch)

            async def enroll(inst: str) -> None:
                key = ec.generate_private_key(ec.SECP256R1())
                csr = (
                    x509.CertificateSigningRequestBuilder()
                    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, inst)]))
                    .sign(key, hashes.SHA256())
                    .public_bytes(serialization.Encoding.PEM)
                )
                async with sem:
                    resp = await stub.Enroll(
                        pb.EnrollRequest(instance_id=inst, token=tokens[inst], csr_pem=csr),
                        timeout=60,
                    )
                identities[inst] = (
                    key.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    ),
                    resp.certificate_pem,
                )

            await asyncio.gather(*(enroll(i) for i in ids))
        setup_s = time.perf_counter() - t_setup

        stop = asyncio.Event()
        registered = 0
        heartbeats = 0

        async def agent(inst: str) -> None:
            nonlocal registered, heartbeats
            key_pem, cert_pem = identities[inst]
            c = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key_pem, certificate_chain=cert_pem
            )
            async with grpc.aio.secure_channel(server.grpc_target, c, options=opts) as ch:
                call = pb_grpc.AgentLinkStub(ch).Connect()
                await call.write(pb.AgentMessage(register=pb.Register(instance_id=inst)))
                ack = await call.read()
                interval = ack.register_ack.heartbeat_interval_ms / 1000.0
                registered += 1

                async def drain() -> None:
                    while await call.read() is not grpc.aio.EOF:
                        pass

                reader = asyncio.create_task(drain())
                await asyncio.sleep(interval * (hash(inst) % 1000) / 1000.0)
                while not stop.is_set():
                    await call.write(
                        pb.AgentMessage(
                            heartbeat=pb.Heartbeat(
                                time_unix_ms=int(time.time() * 1000),
                                cpu_percent=1.0,
                                memory_used_bytes=1 << 28,
                                memory_total_bytes=1 << 29,
                                disk_used_bytes=1 << 30,
                                disk_total_bytes=1 << 32,
                                load1=0.1,
                            )
                        )
                    )
                    heartbeats += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval)
                reader.cancel()
                call.cancel()

        t_conn = time.perf_counter()
        agents = []
        for i, inst in enumerate(ids):
            agents.append(asyncio.create_task(agent(inst)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        deadline = time.monotonic() + 120
        while registered < count and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        connect_s = time.perf_counter() - t_conn
        await asyncio.sleep(5)  # settle: every agent has sent a heartbeat
        pid = server.pid

        def cpu() -> float:
            return process_cpu_seconds(pid)

        def rss_mib() -> float:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
            return 0.0

        hb0, c0, w0 = heartbeats, cpu(), time.perf_counter()
        await asyncio.sleep(window)
        c1, w1, hb1 = cpu(), time.perf_counter(), heartbeats
        rss = rss_mib()
        _status, text = server.api("GET", "/metrics")
        connected = 0.0
        for line in (text.decode() if isinstance(text, bytes) else "").splitlines():
            if line.startswith('sandbox_agents{state="connected"}'):
                connected = float(line.split()[-1])
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents, return_exceptions=True), 60)
        RESULTS["agent_links"] = {
            "agents": count,
            "registered": registered,
            "connected_per_server": int(connected),
            "setup_seconds": round(setup_s, 1),
            "connect_seconds": round(connect_s, 1),
            "heartbeat_interval_s": 5.0,
            "heartbeats_per_s": round((hb1 - hb0) / (w1 - w0), 1),
            "server_cpu_pct_of_core": round((c1 - c0) / (w1 - w0) * 100, 1),
            "server_rss_mib": round(rss, 1),
            "window_seconds": window,
            "target": "RSS <= 500 MiB, CPU <= 20 % of a core",
        }
    finally:
        server.stop()


# ==================================================================== driver
def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


async def run(tmp: Path, args: argparse.Namespace) -> None:
    only = set(args.only or [])

    def want(name: str) -> bool:
        return not only or name in only

    need_session_server = any(
        want(n) for n in ("keystroke", "throughput", "fanout", "stalled", "ctrlc", "redacted")
    )
    if need_session_server:
        server = ServerProcess(
            tmp / "server",
            env={
                "SANDBOX_SESSION_MAX_OBSERVERS": "200",
                "SANDBOX_SESSION_CLIENT_STALL_SECONDS": "600",
                "SANDBOX_RATE_LIMIT_PER_MINUTE": "1000000",
                "SANDBOX_RATE_LIMIT_BURST": "100000",
                "SANDBOX_LOG_LEVEL": "WARNING",
            },
        ).start()
        agent = start_agent(server, "bench-1", tmp)
        try:
            n = 200 if args.quick else 1000
            if want("keystroke"):
                await bench_keystrokes(server, agent.instance_id, n)
                print_partial("keystroke_rtt")
            size = (64 if args.quick else 256) * 1024 * 1024
            if want("throughput"):
                RESULTS["throughput_1_observer"] = await bench_flood(
                    server, agent.instance_id, 1, size
                )
                print_partial("throughput_1_observer")
            if want("fanout"):
                for count in (10, 100):
                    per = max(8, (size // (1024 * 1024)) // (count // 5)) * 1024 * 1024
                    RESULTS[f"fanout_{count}_observers"] = await bench_flood(
                        server, agent.instance_id, count, per
                    )
                    print_partial(f"fanout_{count}_observers")
            if want("stalled"):
                await bench_stalled(server, agent.instance_id, 2 * n)
                print_partial("stalled_observer")
            if want("ctrlc"):
                await bench_ctrl_c(server, agent.instance_id, 3 if args.quick else 10)
                print_partial("ctrl_c")
            if want("redacted"):  # last: the bound secret applies to later sessions
                server.ok(
                    "PUT",
                    "/api/v2/admin/secrets/BENCH_SECRET",
                    {
                        "value": REDACT_SECRET,
                        "instances": [agent.instance_id],
                        "env_name": "BENCH_SECRET",
                    },
                )
                RESULTS["throughput_redacted"] = await bench_flood(
                    server, agent.instance_id, 1, size, REDACT_FLOOD
                )
                print_partial("throughput_redacted")
        finally:
            agent.stop()
            server.stop()
    if want("redactor"):
        bench_redactor(16 * 1024 * 1024 if args.quick else 128 * 1024 * 1024)
        print_partial("redactor")
    if want("agents"):
        await bench_agent_links(tmp, 200 if args.quick else 1000, 10 if args.quick else 30)
        print_partial("agent_links")


def print_partial(name: str) -> None:
    print(f"  {name}: {json.dumps(RESULTS[name])}", flush=True)


def table() -> str:
    rows: list[tuple[str, str, str]] = []
    k = RESULTS.get("keystroke_rtt")
    if k:
        b, s = k["baseline_direct_ws_pty"], k["server"]
        rows.append(
            (
                "keystroke RTT p50 (baseline -> server)",
                f"{b['p50_ms']:.3f} -> {s['p50_ms']:.3f} ms",
                f"x{k['ratio_p50']}",
            )
        )
        rows.append(
            (
                "keystroke RTT p99 (baseline -> server)",
                f"{b['p99_ms']:.3f} -> {s['p99_ms']:.3f} ms",
                f"+{k['added_p99_ms']:.3f} ms (<= 2)",
            )
        )
    t = RESULTS.get("throughput_1_observer")
    if t:
        rows.append(
            (
                "throughput, 1 session -> 1 observer",
                f"{t['aggregate_MB_s']} MB/s",
                f">= 50; server {t['server_cpu_ms_per_MB']} ms CPU/MB",
            )
        )
    t = RESULTS.get("throughput_redacted")
    if t:
        rows.append(
            (
                "throughput with a bound secret",
                f"{t['aggregate_MB_s']} MB/s",
                f"server {t['server_cpu_ms_per_MB']} ms CPU/MB",
            )
        )
    rd = RESULTS.get("redactor")
    if rd:
        for key, label in (("flood_64KiB_chunks", "64 KiB"), ("keystrokes_1_byte", "1-byte")):
            v = rd[key]
            rows.append(
                (
                    f"redactor alone, {label} writes",
                    f"{v['MB_s']} MB/s",
                    f"{v['us_per_feed']} us per write, {rd['secrets']} secrets",
                )
            )
    for n in (10, 100):
        f = RESULTS.get(f"fanout_{n}_observers")
        if f:
            rows.append(
                (
                    f"fan-out to {n} observers (aggregate)",
                    f"{f['aggregate_MB_s']} MB/s",
                    f">= 300; resyncs {f['resyncs']}",
                )
            )
    s2 = RESULTS.get("stalled_observer")
    if s2:
        rows.append(
            (
                "echo p99 without -> with stalled observer",
                f"{s2['echo_without']['p99_ms']:.3f} -> "
                f"{s2['echo_with_stalled_observer']['p99_ms']:.3f} ms",
                f"{s2['p99_change_pct']:+.1f} % (< 10); trials {s2['p99_change_pct_per_trial']}",
            )
        )
    c = RESULTS.get("ctrl_c")
    if c:
        rows.append(
            (
                "Ctrl-C -> flood stopped (p50 / max)",
                f"{c['p50_ms']:.1f} / {c['max_ms']:.1f} ms",
                "<= 200",
            )
        )
    a = RESULTS.get("agent_links")
    if a:
        rows.append(
            (f"{a['agents']} agent links: server RSS", f"{a['server_rss_mib']} MiB", "<= 500")
        )
        rows.append(
            (
                f"{a['agents']} agent links: server CPU",
                f"{a['server_cpu_pct_of_core']} % of a core",
                "<= 20",
            )
        )
    width = max(len(r[0]) for r in rows) if rows else 10
    lines = [f"{'benchmark':<{width}}  {'result':<28} target / note", "-" * (width + 50)]
    lines += [f"{n:<{width}}  {v:<28} {note}" for n, v, note in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts (a smoke run)")
    ap.add_argument(
        "--only",
        nargs="*",
        choices=[
            "keystroke",
            "throughput",
            "fanout",
            "stalled",
            "ctrlc",
            "redacted",
            "redactor",
            "agents",
        ],
    )
    ap.add_argument("--baseline-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_server:
        baseline_server(args.baseline_server)
        return 0
    import uvloop

    RESULTS["machine"] = machine()
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        uvloop.run(run(Path(tmp), args))
    RESULTS["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print(table())
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    merged: dict[str, Any] = {}
    if args.only and (out / "sessions.json").exists():
        # A partial run updates its own entries and keeps the others.
        with contextlib.suppress(ValueError):
            merged = json.loads((out / "sessions.json").read_text())
    merged.update(RESULTS)
    (out / "sessions.json").write_text(json.dumps(merged, indent=2) + "\n")
    print(f"\nwrote {out / 'sessions.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
