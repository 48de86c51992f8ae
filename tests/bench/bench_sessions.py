"""Session benchmarks: keystroke round trip, throughput, fan-out, stalled observer, Ctrl-C,
1000 agent links (or ``--links 5000``).

Run: ``.venv/bin/python tests/bench/bench_sessions.py [--quick] [--only NAME ...] [--links N]``.
Prints a table and writes ``bench-results/sessions.json``. Everything runs on loopback: a real
`sandbox-server` subprocess, a real `agent-client` (real PTYs, gRPC over mutual TLS), and this
process as the WebSocket clients. Every loop is bounded in count and time.

Every comparison runs beside a direct WebSocket -> PTY relay (no server, no agent, no gRPC; same
framing, same command, bounded and lossless), in interleaved rounds, with the server, its agent
and the relay pinned to CPU 0 and this client to CPU 1; CPU per operation comes from
`/proc/<pid>/stat` of the server and the agent (each reported) and of the relay. Targets
(docs: ../shared/spec/quality.md), as ratios to the relay:
  keystroke          WS input -> server -> agent -> PTY -> `cat` echo -> ... -> WS: p50 <= 1.5x,
                     server + agent CPU per keystroke <= 3x the relay's
  output             one session's flood to one observer: >= 0.85x the relay's MB/s; the same
                     flood to 10 observers: aggregate >= 4x the relay's one-client rate
  ctrlc              `yes` flood in bash, Ctrl-C -> prompt back: p50 <= the relay's + 2 ms
Server only:
  fanout             100 observers (aggregate MB/s)
  stalled            controller echo p99 with a never-reading observer attached moves < 10 %
  redacted           a flood with a secret bound to the instance: text lines that hold a
                     secret's prefix and the whole secret (redaction on the output path)
  redactor           the redactor alone, in this process
  agents             1000 simulated agents with heartbeats (the real agent's channel settings and
                     its rule for asking answers): server RSS <= 500 MiB, CPU <= 20 %
                     (``--links 5000``: RSS <= 1 GiB, CPU <= 20 %)
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from tests.support.agents import start_agent  # noqa: E402
from tests.support.measure import cpu_seconds, pct, pin_tree  # noqa: E402
from tests.support.server import ServerProcess, free_port  # noqa: E402

SUBPROTOCOL = "sandbox.pty.v1"
# Both paths echo through a process: the PTY is raw (no kernel echo), `cat` writes back what
# it reads, as a shell's line editor does.
ECHO_CMD = ["sh", "-c", "stty raw -echo; exec cat"]
LETTERS = b"abcdefghijklmnopqrstuvwxyz"
RESULTS: dict[str, Any] = {}


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
    """A direct WebSocket -> PTY relay (no server, no agent, no gRPC), same framing (an 8-byte
    offset before each output frame), bounded and lossless: the PTY is read only while fewer
    than 64 frames wait for the socket, as the server path reads only as fast as it drains.
    The command comes with the request (`spec`: JSON `{"command": [...], "env": {...}}`), so
    both paths run the same one."""
    import fcntl

    import uvloop
    from aiohttp import web
    from ptyprocess import PtyProcess

    async def handler(request: web.Request) -> web.WebSocketResponse:
        spec = json.loads(request.query["spec"])
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), compress=False, max_msg_size=0)
        await ws.prepare(request)
        env = {**os.environ, "TERM": "xterm-256color", **spec.get("env", {})}
        proc = PtyProcess.spawn(spec["command"], dimensions=(24, 80), env=env)
        fd = proc.fd
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        loop = asyncio.get_running_loop()
        offset = 0
        pending: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)
        reading = False

        def readable() -> None:
            nonlocal offset, reading
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
                reading = False
                return
            pending.put_nowait(struct.pack(">Q", offset) + data)
            offset += len(data)
            if pending.full():  # backpressure: stop reading until the socket drains
                loop.remove_reader(fd)
                reading = False

        def resume() -> None:
            nonlocal reading
            if not reading and not pending.full():
                loop.add_reader(fd, readable)
                reading = True

        async def writer() -> None:
            while True:
                frame = await pending.get()
                resume()
                await ws.send_bytes(frame)

        resume()
        task = asyncio.create_task(writer())
        try:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    os.write(fd, msg.data)
        finally:
            if reading:
                loop.remove_reader(fd)
            task.cancel()
            proc.terminate(force=True)
        return ws

    app = web.Application()
    app.router.add_get("/attach", handler)
    uvloop.run(web._run_app(app, host="127.0.0.1", port=port, print=None))


class Relay:
    """The direct relay as a subprocess (pinned with the server and agent)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--baseline-server", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def url(self, command: list[str], env: dict[str, str] | None = None) -> str:
        from urllib.parse import quote

        spec = json.dumps({"command": command, "env": env or {}})
        return f"ws://127.0.0.1:{self.port}/attach?spec={quote(spec)}"

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        for _ in range(200):
            try:
                ws = await ws_connect(http, self.url(["true"]), None)
                await ws.close()
                return
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
        raise RuntimeError("baseline relay did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ==================================================================== pinning and CPU
def pin_process(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def context_switches(pid: int) -> int:
    """Voluntary context switches of all of a process's threads so far (a thread hop, a wait
    for I/O: each is one)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


class Cpu:
    """CPU seconds (and voluntary context switches) of named processes between two points."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = {k: cpu_seconds(p) for k, p in pids.items()}
        self.cs0 = {k: context_switches(p) for k, p in pids.items()}

    def done(self) -> dict[str, float]:
        return {k: cpu_seconds(p) - self.t0[k] for k, p in self.pids.items()}

    def switches(self) -> dict[str, int]:
        return {k: context_switches(p) - self.cs0[k] for k, p in self.pids.items()}


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


@dataclass
class Bench:
    """What every interleaved benchmark uses: the server, its agent, the direct relay."""

    server: ServerProcess
    instance: str
    agent_pid: int
    relay: Relay

    def server_pids(self) -> dict[str, int]:
        return {"server": self.server.pid, "agent": self.agent_pid}


# ==================================================================== benchmarks
def us_per(cpu: dict[str, float], n: int) -> dict[str, float]:
    return {k: round(v / n * 1e6, 1) for k, v in cpu.items()}


async def bench_keystrokes(b: Bench, n: int, rounds: int) -> None:
    """Keystroke round trips, rounds alternating between the relay and the server (ABBA), each
    path's processes' CPU measured around its own rounds."""
    per = max(1, n // rounds)
    async with aiohttp.ClientSession() as http:
        bws = await ws_connect(http, b.relay.url(ECHO_CMD), None)
        sid = create(b.server, b.instance, ECHO_CMD)
        sws = await ws_connect(
            http, attach_url(b.server, sid), b.server.admin_token, role="control"
        )
        await keystrokes(bws, 0, 50)
        await keystrokes(sws, 0, 50)
        base_rtt: list[float] = []
        srv_rtt: list[float] = []
        base_cpu = {"relay": 0.0}
        srv_cpu = {"server": 0.0, "agent": 0.0}
        base_cs = {"relay": 0}
        srv_cs = {"server": 0, "agent": 0}
        for r in range(rounds):
            order = ("relay", "server") if r % 2 == 0 else ("server", "relay")
            for path in order:
                if path == "relay":
                    cpu = Cpu({"relay": b.relay.pid})
                    base_rtt += await keystrokes(bws, per, 0)
                    for k, v in cpu.done().items():
                        base_cpu[k] += v
                    for k, c in cpu.switches().items():
                        base_cs[k] += c
                else:
                    cpu = Cpu(b.server_pids())
                    srv_rtt += await keystrokes(sws, per, 0)
                    for k, v in cpu.done().items():
                        srv_cpu[k] += v
                    for k, c in cpu.switches().items():
                        srv_cs[k] += c
        await bws.close()
        await sws.close()
        b.server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    bm, sm = ms(base_rtt), ms(srv_rtt)
    base_us = us_per(base_cpu, len(base_rtt))
    srv_us = us_per(srv_cpu, len(srv_rtt))
    srv_total = round(srv_us["server"] + srv_us["agent"], 1)
    RESULTS["keystroke_rtt"] = {
        "command": ECHO_CMD,
        "rounds": rounds,
        "baseline_direct_ws_pty": {
            **bm,
            "cpu_us_per_keystroke": base_us["relay"],
            "context_switches_per_keystroke": round(base_cs["relay"] / len(base_rtt), 2),
        },
        "server": {
            **sm,
            "server_context_switches_per_keystroke": round(srv_cs["server"] / len(srv_rtt), 2),
            "agent_context_switches_per_keystroke": round(srv_cs["agent"] / len(srv_rtt), 2),
            "server_threads": len(os.listdir(f"/proc/{b.server.pid}/task")),
            "agent_threads": len(os.listdir(f"/proc/{b.agent_pid}/task")),
            "cpu_us_per_keystroke": srv_total,
            "server_cpu_us_per_keystroke": srv_us["server"],
            "agent_cpu_us_per_keystroke": srv_us["agent"],
        },
        "added_p50_ms": round(sm["p50_ms"] - bm["p50_ms"], 3),
        "added_p99_ms": round(sm["p99_ms"] - bm["p99_ms"], 3),
        "ratio_p50": round(sm["p50_ms"] / bm["p50_ms"], 2),
        "ratio_p99": round(sm["p99_ms"] / bm["p99_ms"], 2),
        "ratio_cpu": round(srv_total / base_us["relay"], 2) if base_us["relay"] else None,
        "target": "p50 <= 1.5x the relay's; server+agent CPU per keystroke <= 3x the relay's",
    }


FLOOD_END = b"END-OF-FLOOD"


async def _observer(
    http: aiohttp.ClientSession,
    url: str,
    token: str | None,
    stats: dict[str, Any],
    **params: str,
) -> None:
    if token:
        params["from"] = "0"
    ws = await ws_connect(http, url, token, **params)
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


def flood_command(observers: int, size: int, source: str) -> list[str]:
    wait = 1.0 + observers * 0.03  # the observers attach before the flood starts
    return [
        "sh",
        "-c",
        f"stty -opost -echo; sleep {wait:.2f}; {source.format(size=size)}; "
        f"printf {FLOOD_END.decode()}; sleep 600",
    ]


def flood_result(
    stats: list[dict[str, Any]], size: int, observers: int, cpu: dict[str, float]
) -> dict[str, Any]:
    total = sum(st["bytes"] for st in stats)
    start = min(st["first"] for st in stats if st["first"])
    end = max(st["last"] for st in stats)
    per = [st["bytes"] / (st["last"] - st["first"]) / 1e6 for st in stats if st["first"]]
    mb = size / 1e6
    return {
        "observers": observers,
        "flood_bytes": size,
        "aggregate_MB_s": round(total / (end - start) / 1e6, 1),
        "per_observer_MB_s_p50": round(pct(per, 50), 1),
        "seconds": round(end - start, 2),
        "resyncs": sum(st.get("resyncs", 0) for st in stats),
        "delivered_fraction": round(total / (size * observers), 3),
        # the whole flood, session start and observer connects included
        **{f"{k}_cpu_ms_per_MB": round(v * 1000 / mb, 2) for k, v in cpu.items()},
        "cpu_ms_per_MB": round(sum(cpu.values()) * 1000 / mb, 2),
    }


async def bench_flood(
    b: Bench, observers: int, size: int, source: str = ZERO_FLOOD
) -> dict[str, Any]:
    """One flood through the server to `observers` observers."""
    cpu = Cpu(b.server_pids())
    sid = create(b.server, b.instance, flood_command(observers, size, source))
    stats: list[dict[str, Any]] = [{} for _ in range(observers)]
    url, token = attach_url(b.server, sid), b.server.admin_token
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [
            asyncio.create_task(_observer(http, url, token, st, role="observe")) for st in stats
        ]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    used = cpu.done()
    b.server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    return flood_result(stats, size, observers, used)


async def relay_flood(b: Bench, size: int, source: str = ZERO_FLOOD) -> dict[str, Any]:
    """The same flood through the direct relay to its one client."""
    cpu = Cpu({"relay": b.relay.pid})
    stats: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        await asyncio.wait_for(
            _observer(http, b.relay.url(flood_command(1, size, source)), None, stats), 300
        )
    return flood_result([stats], size, 1, cpu.done())


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


async def bench_output(b: Bench, size: int, rounds: int, fanout: int) -> None:
    """Rounds of: the relay to one client, the server to one observer, the server to `fanout`
    observers — in a rotating order so background load hits all alike."""
    runs: dict[str, list[dict[str, Any]]] = {"relay": [], "server": [], "fanout": []}
    fan_size = max(8 * 1024 * 1024, size // 2)
    kinds = ["relay", "server", "fanout"]
    for r in range(rounds):
        order = kinds[r % 3 :] + kinds[: r % 3]
        for kind in order:
            if kind == "relay":
                runs[kind].append(await relay_flood(b, size))
            elif kind == "server":
                runs[kind].append(await bench_flood(b, 1, size))
            else:
                runs[kind].append(await bench_flood(b, fanout, fan_size))
    summary = {}
    for kind, rs in runs.items():
        summary[kind] = {
            "rounds": rs,
            "aggregate_MB_s_median": median_of(rs, "aggregate_MB_s"),
            "cpu_ms_per_MB_median": median_of(rs, "cpu_ms_per_MB"),
        }
    for k in ("server", "agent"):
        for kind in ("server", "fanout"):
            summary[kind][f"{k}_cpu_ms_per_MB_median"] = median_of(runs[kind], f"{k}_cpu_ms_per_MB")
    relay = summary["relay"]["aggregate_MB_s_median"]
    RESULTS["output"] = {
        "flood_bytes": size,
        "fanout_observers": fanout,
        "fanout_flood_bytes": fan_size,
        **summary,
        "ratio_throughput": round(summary["server"]["aggregate_MB_s_median"] / relay, 2),
        "ratio_fanout_aggregate": round(summary["fanout"]["aggregate_MB_s_median"] / relay, 2),
        "target": "one session >= 0.85x the relay's MB/s; "
        f"{fanout} observers >= 4x the relay's one-client rate",
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


SHELL_CMD = ["bash", "--norc", "--noprofile", "-i"]
SHELL_ENV = {"PS1": "PROMPT> "}


class Shell:
    """An interactive bash on one path: flood with `yes`, Ctrl-C, time until the prompt."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.buf = b""
        self.bytes = 0

    async def until(self, pred: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            msg = await self.ws.receive(timeout=max(0.01, deadline - time.monotonic()))
            if msg.type == aiohttp.WSMsgType.BINARY:
                self.buf = self.buf[-64:] + msg.data[8:]
                self.bytes += len(msg.data) - 8
            elif msg.type not in (aiohttp.WSMsgType.TEXT,):
                raise RuntimeError(f"connection ended: {msg.type}")

    async def one(self) -> tuple[float, int]:
        self.buf, self.bytes = b"", 0
        await self.ws.send_bytes(b"yes\r")
        await self.until(lambda: self.bytes > 4 * 1024 * 1024, 30)  # flooding for real
        self.buf = b""
        t0 = time.perf_counter()
        await self.ws.send_bytes(b"\x03")
        await self.until(lambda: b"PROMPT> " in self.buf, 10)
        return time.perf_counter() - t0, self.bytes


async def bench_ctrl_c(b: Bench, rounds: int) -> None:
    sid = create(b.server, b.instance, SHELL_CMD, env=SHELL_ENV)
    lat: dict[str, list[float]] = {"relay": [], "server": []}
    async with aiohttp.ClientSession() as http:
        shells = {
            "relay": Shell(await ws_connect(http, b.relay.url(SHELL_CMD, SHELL_ENV), None)),
            "server": Shell(
                await ws_connect(
                    http,
                    attach_url(b.server, sid),
                    b.server.admin_token,
                    role="control",
                    **{"from": "0"},
                )
            ),
        }
        for sh in shells.values():
            await sh.until(lambda sh=sh: b"PROMPT> " in sh.buf, 10)
        for r in range(rounds):
            for path in ("relay", "server") if r % 2 == 0 else ("server", "relay"):
                t, _ = await shells[path].one()
                lat[path].append(t)
                await asyncio.sleep(0.2)  # the shell is idle again
        for sh in shells.values():
            await sh.ws.close()
    b.server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")
    rm, sm = ms(lat["relay"]), ms(lat["server"])
    RESULTS["ctrl_c"] = {
        "command": SHELL_CMD,
        "relay": rm,
        "server": sm,
        "added_p50_ms": round(sm["p50_ms"] - rm["p50_ms"], 3),
        "target": "p50 <= the relay's + 2 ms",
    }


# ---- agent links (1000, or --links N) --------------------------------------------------------
def rss_target(links: int) -> int:
    """The server's RSS allowed for `links` agent links (issue 15: 1000 in 500 MiB, 5000 in
    1 GiB)."""
    return 500 if links <= 1000 else 1024


MAX_CONNECT_ATTEMPTS = 20  # a simulated agent's connects, at most


async def bench_agent_links(tmp: Path, count: int, window: float) -> None:
    import grpc
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from agentic_sandbox.agent.channels import CHANNEL_OPTIONS
    from agentic_sandbox.agent.link import ASK_AFTER_INTERVALS
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
        answers = 0  # heartbeat answers heard
        retries = 0
        dropped = 0

        async def register(inst: str) -> tuple[Any, Any, float] | None:
            """Connect and register as the agent `inst`: (channel, call, heartbeat interval).
            Like the real agent it connects again (backing off) when the link fails before
            the answer: a burst of thousands of handshakes in this one client process can hold
            a Register past the server's 10 s wait, and the server then refuses the link."""
            nonlocal retries
            key_pem, cert_pem = identities[inst]
            c = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key_pem, certificate_chain=cert_pem
            )
            for attempt in range(MAX_CONNECT_ATTEMPTS):
                if attempt:
                    retries += 1
                    jitter = 0.5 + (hash((inst, attempt)) % 1000) / 1000.0
                    await asyncio.sleep(min(5.0, 0.5 * 1.6**attempt) * jitter)  # backs off
                # the agent's own channel settings (its keepalive pings among them)
                ch = grpc.aio.secure_channel(server.grpc_target, c, options=link_opts)
                try:
                    call = pb_grpc.AgentLinkStub(ch).Connect()
                    await call.write(
                        pb.AgentMessage(
                            register=pb.Register(
                                instance_id=inst, batches=True, acks_when_asked=True
                            )
                        )
                    )
                    ack = await call.read()
                    if ack is not grpc.aio.EOF:
                        return ch, call, ack.register_ack.heartbeat_interval_ms / 1000.0
                except grpc.aio.AioRpcError:
                    pass
                await ch.close()
            return None

        link_opts = [*CHANNEL_OPTIONS, *opts]

        async def drain(call: Any, heard: list[float]) -> None:
            nonlocal answers
            loop = asyncio.get_running_loop()
            while (msg := await call.read()) is not grpc.aio.EOF:
                heard[0] = loop.time()
                answers += msg.WhichOneof("body") == "heartbeat_ack"

        async def agent(inst: str) -> None:
            """One simulated agent: registers, then heartbeats until `stop`."""
            nonlocal registered, heartbeats, dropped
            linked = await register(inst)
            if linked is None:
                return
            ch, call, interval = linked
            registered += 1
            loop = asyncio.get_running_loop()
            heard = [loop.time()]
            reader = asyncio.create_task(drain(call, heard))
            ask = True  # as the real agent (agent/link.py): the first, then after silence
            try:
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
                                want_ack=ask,
                            )
                        )
                    )
                    heartbeats += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval)
                    ask = loop.time() - heard[0] >= ASK_AFTER_INTERVALS * interval
            except grpc.aio.AioRpcError:  # lost after it registered: counted, not retried
                dropped += 1
                registered -= 1
            finally:
                reader.cancel()
                call.cancel()
                await ch.close()

        t_conn = time.perf_counter()
        agents = []
        for i, inst in enumerate(ids):
            agents.append(asyncio.create_task(agent(inst)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        deadline = time.monotonic() + 120 + count * 0.05
        while registered < count and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        connect_s = time.perf_counter() - t_conn

        def metric(series: str) -> float | None:
            """One sample of the server's /metrics (None when it has no such series)."""
            _status, text = server.api("GET", "/metrics")
            for line in (text.decode() if isinstance(text, bytes) else "").splitlines():
                if line.startswith(series + " "):
                    return float(line[len(series) + 1 :])
            return None

        def full_collections() -> int:
            """The server's full (generation 2) garbage collections so far."""
            got = metric('python_gc_collections_total{generation="2"}')
            if got is None:
                raise SystemExit("the server's /metrics has no python_gc_collections_total")
            return int(got)

        # settle: every agent has sent a heartbeat, and the full collection that the connect
        # storm's new long-lived objects cause has run (a one-off, not a heartbeat's cost:
        # waited for at most 30 s, and the window's own full collections are reported)
        gc_at_connect = full_collections()
        await asyncio.sleep(5)
        settle_until = time.monotonic() + 25
        while full_collections() == gc_at_connect and time.monotonic() < settle_until:
            await asyncio.sleep(1)
        storm_gc = full_collections() > gc_at_connect
        pid = server.pid

        def cpu() -> float:
            return cpu_seconds(pid)

        def rss_mib() -> float:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
            return 0.0

        gc0 = full_collections()
        hb0, an0, c0, w0 = heartbeats, answers, cpu(), time.perf_counter()
        await asyncio.sleep(window)
        c1, w1, hb1, an1 = cpu(), time.perf_counter(), heartbeats, answers
        gc1 = full_collections()
        rss = rss_mib()
        connected = metric('sandbox_agents{state="connected"}') or 0.0
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents, return_exceptions=True), 60)
        RESULTS["agent_links"] = {
            "agents": count,
            "registered": registered,
            "connected_per_server": int(connected),
            "setup_seconds": round(setup_s, 1),
            "connect_seconds": round(connect_s, 1),
            "connect_retries": retries,
            "dropped_after_register": dropped,
            "heartbeat_interval_s": 5.0,
            "heartbeats_per_s": round((hb1 - hb0) / (w1 - w0), 1),
            "answers_per_s": round((an1 - an0) / (w1 - w0), 1),
            "server_cpu_pct_of_core": round((c1 - c0) / (w1 - w0) * 100, 1),
            "server_rss_mib": round(rss, 1),
            "window_seconds": window,
            "storm_full_gc_before_window": storm_gc,
            "full_gc_in_window": gc1 - gc0,
            "target_rss_mib": rss_target(count),
            "target": f"RSS <= {rss_target(count)} MiB, CPU <= 20 % of a core",
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
        want(n) for n in ("keystroke", "output", "fanout", "stalled", "ctrlc", "redacted")
    )
    if need_session_server:
        pinned = (os.cpu_count() or 1) >= 2
        if pinned:  # the server, its agent and the relay on CPU 0, this client on CPU 1
            pin_tree({0})
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
        relay = Relay()
        assert agent.proc is not None
        if pinned:
            for pid in (server.pid, agent.proc.pid, agent.worker_pid(), relay.pid):
                pin_process(pid, {0})
            pin_tree({1})
        RESULTS["machine"]["pinned"] = (
            "server, agent, relay: CPU 0; client: CPU 1" if pinned else "no (one CPU)"
        )
        b = Bench(server, agent.instance_id, agent.worker_pid(), relay)
        try:
            async with aiohttp.ClientSession() as http:
                await relay.wait_ready(http)
            n = 400 if args.quick else 2000
            rounds = 3 if args.quick else 8
            if want("keystroke"):
                await bench_keystrokes(b, n, rounds)
                print_partial("keystroke_rtt")
            size = (32 if args.quick else 200) * 1024 * 1024
            if want("output"):
                await bench_output(b, size, rounds, 10)
                print_partial("output")
            if want("fanout"):
                per = max(8, (size // (1024 * 1024)) // 20) * 1024 * 1024
                RESULTS["fanout_100_observers"] = await bench_flood(b, 100, per)
                print_partial("fanout_100_observers")
            if want("stalled"):
                await bench_stalled(server, agent.instance_id, n)
                print_partial("stalled_observer")
            if want("ctrlc"):
                await bench_ctrl_c(b, 4 if args.quick else 10)
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
                RESULTS["throughput_redacted"] = await bench_flood(b, 1, size, REDACT_FLOOD)
                print_partial("throughput_redacted")
        finally:
            relay.stop()
            agent.stop()
            server.stop()
    if want("redactor"):
        bench_redactor(16 * 1024 * 1024 if args.quick else 128 * 1024 * 1024)
        print_partial("redactor")
    if want("agents"):
        links = args.links or (200 if args.quick else 1000)
        await bench_agent_links(tmp, max(10, min(links, 10_000)), 10 if args.quick else 30)
        print_partial("agent_links")


def print_partial(name: str) -> None:
    print(f"  {name}: {json.dumps(RESULTS[name])}", flush=True)


def comparison_rows() -> list[tuple[str, str, str, str, str, str]]:
    """measure, server + agent, direct relay, ratio, target, met."""
    rows: list[tuple[str, str, str, str, str, str]] = []

    def met(ok: bool) -> str:
        return "yes" if ok else "NO"

    k = RESULTS.get("keystroke_rtt")
    if k:
        b, s = k["baseline_direct_ws_pty"], k["server"]
        rows.append(
            (
                "keystroke round trip p50",
                f"{s['p50_ms']:.3f} ms",
                f"{b['p50_ms']:.3f} ms",
                f"{k['ratio_p50']}x",
                "<= 1.5x",
                met(k["ratio_p50"] <= 1.5),
            )
        )
        rows.append(
            (
                "keystroke round trip p99",
                f"{s['p99_ms']:.3f} ms",
                f"{b['p99_ms']:.3f} ms",
                f"{k['ratio_p99']}x",
                "",
                "",
            )
        )
        rows.append(
            (
                "CPU per keystroke (server + agent)",
                f"{s['cpu_us_per_keystroke']} us ({s['server_cpu_us_per_keystroke']} + "
                f"{s['agent_cpu_us_per_keystroke']})",
                f"{b['cpu_us_per_keystroke']} us",
                f"{k['ratio_cpu']}x",
                "<= 3x",
                met(k["ratio_cpu"] is not None and k["ratio_cpu"] <= 3),
            )
        )
        rows.append(
            (
                "context switches per keystroke",
                f"{s['server_context_switches_per_keystroke']} + "
                f"{s['agent_context_switches_per_keystroke']}",
                f"{b['context_switches_per_keystroke']}",
                "",
                "",
                "",
            )
        )
    o = RESULTS.get("output")
    if o:
        r, s, f = o["relay"], o["server"], o["fanout"]
        mb = o["flood_bytes"] // (1024 * 1024)
        rows.append(
            (
                f"one session's output ({mb} MiB, median)",
                f"{s['aggregate_MB_s_median']} MB/s",
                f"{r['aggregate_MB_s_median']} MB/s",
                f"{o['ratio_throughput']}x",
                ">= 0.85x",
                met(o["ratio_throughput"] >= 0.85),
            )
        )
        rows.append(
            (
                "CPU per MB of output (server + agent)",
                f"{s['cpu_ms_per_MB_median']} ms ({s['server_cpu_ms_per_MB_median']} + "
                f"{s['agent_cpu_ms_per_MB_median']})",
                f"{r['cpu_ms_per_MB_median']} ms",
                f"{round(s['cpu_ms_per_MB_median'] / r['cpu_ms_per_MB_median'], 2)}x"
                if r["cpu_ms_per_MB_median"]
                else "",
                "",
                "",
            )
        )
        rows.append(
            (
                f"fan-out to {o['fanout_observers']} observers (aggregate)",
                f"{f['aggregate_MB_s_median']} MB/s",
                f"{r['aggregate_MB_s_median']} MB/s (1 client)",
                f"{o['ratio_fanout_aggregate']}x",
                ">= 4x",
                met(o["ratio_fanout_aggregate"] >= 4),
            )
        )
    c = RESULTS.get("ctrl_c")
    if c:
        rows.append(
            (
                "Ctrl-C during a flood, p50",
                f"{c['server']['p50_ms']:.2f} ms",
                f"{c['relay']['p50_ms']:.2f} ms",
                f"+{c['added_p50_ms']:.2f} ms",
                "<= +2 ms",
                met(c["added_p50_ms"] <= 2),
            )
        )
    return rows


def table() -> str:
    lines: list[str] = []
    m = RESULTS.get("machine", {})
    lines.append(
        f"load average at start {m.get('loadavg_at_start')}, at end {m.get('loadavg_at_end')}; "
        f"pinned: {m.get('pinned', 'no')}"
    )
    cmp_rows = comparison_rows()
    if cmp_rows:
        head = ("measure", "server + agent", "direct relay", "ratio", "target", "met")
        widths = [max(len(r[i]) for r in [head, *cmp_rows]) for i in range(6)]
        for row in [head, tuple("-" * w for w in widths), *cmp_rows]:
            lines.append(" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
        lines.append("")
    rows: list[tuple[str, str, str]] = []
    t = RESULTS.get("throughput_redacted")
    if t:
        rows.append(
            (
                "throughput with a bound secret",
                f"{t['aggregate_MB_s']} MB/s",
                f"server + agent {t['cpu_ms_per_MB']} ms CPU/MB",
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
    f = RESULTS.get("fanout_100_observers")
    if f:
        rows.append(
            (
                "fan-out to 100 observers (aggregate)",
                f"{f['aggregate_MB_s']} MB/s",
                f"resyncs {f['resyncs']}",
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
    a = RESULTS.get("agent_links")
    if a:
        rows.append(
            (
                f"{a['agents']} agent links: server RSS",
                f"{a['server_rss_mib']} MiB",
                f"<= {a.get('target_rss_mib', 500)}",
            )
        )
        rows.append(
            (
                f"{a['agents']} agent links: server CPU",
                f"{a['server_cpu_pct_of_core']} % of a core",
                f"<= 20; full GCs in the window: {a.get('full_gc_in_window', '?')} "
                f"(the connect storm's before it: {a.get('storm_full_gc_before_window', '?')})",
            )
        )
        rows.append(
            (
                f"{a['agents']} agent links: registered",
                f"{a['registered']} ({a.get('connect_retries', 0)} connects retried)",
                f"heartbeats {a['heartbeats_per_s']}/s, answered {a.get('answers_per_s', '?')}/s",
            )
        )
    if rows:
        width = max(len(r[0]) for r in rows)
        lines += [f"{'benchmark':<{width}}  {'result':<28} target / note", "-" * (width + 50)]
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
            "output",
            "fanout",
            "stalled",
            "ctrlc",
            "redacted",
            "redactor",
            "agents",
        ],
    )
    ap.add_argument(
        "--links",
        type=int,
        help="simulated agent links for `agents` (default 1000, 200 with --quick; at most 10000)",
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
        # A partial run updates its own entries and keeps the others, each with its own
        # machine block (load average, time).
        with contextlib.suppress(ValueError):
            merged = json.loads((out / "sessions.json").read_text())
    machine_block = RESULTS.pop("machine")
    for entry in RESULTS.values():
        entry["machine"] = machine_block
    merged.pop("machine", None)
    merged.update(RESULTS)
    (out / "sessions.json").write_text(json.dumps(merged, indent=2) + "\n")
    print(f"\nwrote {out / 'sessions.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
