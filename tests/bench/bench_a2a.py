"""Benchmark: trivial A2A tasks (`true`) end to end through a host-side agent.

    .venv/bin/python tests/bench/bench_a2a.py [--tasks N] [--seconds S] [--binding B]

A real `sandbox-server` process and a real `agent-client` (enrolled, mutual-TLS link, PTYs).
For 1 and 8 concurrent clients it measures:

- **a2a**: the official a2a-sdk client sends a blocking `SendMessage` whose text is `true`
  (the `shell` skill: `bash -lc true` in a PTY session) and gets the completed task back;
- **a2a_raw**: the same SendMessage as a bare JSON-RPC POST (httpx), to tell the server's
  share from the SDK client's;
- **baseline** (same run, same server, same agent): the same command through the agent link
  without the A2A layer — `POST /api/v2/admin/sessions {"command": ["bash", "-lc", "true"]}`
  and the `session.exited` event from the live event stream.

- **sdk_ref** / **sdk_ref_raw**: the same two calls against a reference A2A server built from
  a2a-sdk's own parts (`tests/support/a2a_reference.py`: `DefaultRequestHandler` +
  `InMemoryTaskStore` under uvicorn, its executor running the same `bash -lc true` as a
  subprocess) — the in-run baseline for the A2A layer (issue 15: >= 0.9x its tasks/s at 1 and
  8 clients, p50 <= 1.3x, our server's CPU per task <= 1.5x its whole server's).

Both of our paths are one HTTP request plus a PTY session on the agent, so the difference is
what the A2A layer adds (task store, state machine, scheduler claim, run bookkeeping, A2A
encoding and the SDK client). Batches alternate between the paths to spread drift evenly; the
servers and the agent run on CPU 0, this client on CPU 1 (``--no-pin`` to leave them); CPU per
task comes from /proc of each server process (and our agent). ``--long N``: then N times the
tasks through our A2A path at 8 clients, in ten slices, to show that the CPU per task stays
flat as work accumulates (retained sessions, tasks, events and rows). Prints a table and
writes bench-results/a2a.json. Every loop is bounded by a task count and a time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from a2a.types import a2a_pb2 as pb  # noqa: E402

from tests.support.a2a_sdk_client import a2a_client, send_request, text_message  # noqa: E402
from tests.support.async_processes import AgentProc, ServerProc  # noqa: E402
from tests.support.measure import cpu_seconds, pct, pin_tree  # noqa: E402
from tests.support.server import free_port  # noqa: E402

INSTANCE = "bench-1"
COMMAND = ["bash", "-lc", "true"]
CONCURRENCY = (1, 8)


class ExitWatcher:
    """One SSE connection to /api/v1/events/stream: resolves a future per exited session."""

    def __init__(self, server: ServerProc) -> None:
        self.server = server
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.early: set[str] = set()
        self.task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

    async def run(self) -> None:
        url = self.server.base + "/api/v1/events/stream?type=session.exited"
        headers = {"Authorization": f"Bearer {self.server.admin}"}
        async with (
            httpx.AsyncClient(timeout=None) as http,
            http.stream("GET", url, headers=headers) as resp,
        ):
            self.ready.set()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                sid = ev.get("session_id")
                fut = self.waiting.pop(sid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
                elif sid:
                    self.early.add(sid)

    def wait(self, sid: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if sid in self.early:
            self.early.discard(sid)
            fut.set_result(None)
        else:
            self.waiting[sid] = fut
        return fut


async def run_batch(
    op: Callable[[], Awaitable[None]], concurrency: int, count: int, seconds: float
) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    remaining = count

    async def worker() -> None:
        nonlocal remaining, errors
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            t0 = time.perf_counter()
            try:
                await op()
            except Exception as exc:  # counted, and shown once
                errors += 1
                if errors == 1:
                    print(f"  error: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start, errors


async def start_reference(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.support.a2a_reference"),
            *("--port", str(port), "--home", str(home)),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,  # (its own warnings go to stderr)
    )
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2) as http:
        for _ in range(100):
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(base + "/.well-known/agent-card.json")).status_code == 200:
                    return proc, base
            await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError("the reference A2A server did not start")


def cpu_ms_per_task(cpu: float, tasks: int) -> float | None:
    return round(cpu / tasks * 1000, 2) if tasks else None


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-a2a-"))
    pinned = not args.no_pin and (os.cpu_count() or 1) >= 2
    if pinned:  # the servers and the agent start on CPU 0; this client moves to CPU 1 below
        pin_tree({0})
    server = ServerProc(
        tmp,
        test_settings=False,
        env={
            "SANDBOX_LOG_LEVEL": "WARNING",
            "SANDBOX_TASK_MAX_RUNNING_PER_OWNER": "64",
            "SANDBOX_RATE_LIMIT_PER_MINUTE": "1000000",
            "SANDBOX_RATE_LIMIT_BURST": "100000",
            "SANDBOX_SESSION_RECORDING": os.environ.get("SANDBOX_SESSION_RECORDING", "true"),
        },
    )
    await server.start()
    agent = AgentProc(server, INSTANCE, tmp)
    results: dict[str, Any] = {}
    ref_proc: subprocess.Popen[bytes] | None = None
    try:
        owner = await server.token("bench")
        # Both paths run `bash -lc true` with HOME in the bench's directory: a login shell must
        # not run the machine user's own profile (pyenv, cargo …), which would dwarf the rest.
        home = tmp / "home"
        home.mkdir()
        env = {"HOME": str(home)}
        await agent.enroll_and_start(
            owner, task_runner={"argv": [*COMMAND[:2], "{text}"], "env": env}
        )
        ref_proc, ref_base = await start_reference(home)
        assert agent.proc is not None and agent.proc.proc is not None
        pids = {
            "server": server.proc.pid,
            "agent": agent.proc.worker_pid(),
            "reference": ref_proc.pid,
        }
        if pinned:
            pin_tree({1})
        key = await server.api_key(INSTANCE, ["a2a:read", "a2a:invoke"], owner)
        watcher = ExitWatcher(server)
        watcher.task = asyncio.ensure_future(watcher.run())
        await asyncio.wait_for(watcher.ready.wait(), 10)
        raw = httpx.AsyncClient(
            timeout=60,
            headers={"Authorization": f"Bearer {key}", "A2A-Version": "1.0"},
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
        )
        http = httpx.AsyncClient(
            base_url=server.base,
            timeout=60,
            headers={"Authorization": f"Bearer {owner}"},
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
        )

        async def baseline() -> None:
            r = await http.post(
                "/api/v2/admin/sessions",
                json={"instance_id": INSTANCE, "command": COMMAND, "env": env},
            )
            r.raise_for_status()
            await asyncio.wait_for(watcher.wait(r.json()["id"]), 30)

        agent_url = server.agent_url(INSTANCE)
        async with (
            a2a_client(agent_url, key, args.binding, streaming=False) as (client, _),
            a2a_client(ref_base, "", "JSONRPC", streaming=False, signed=False) as (ref_client, _),
        ):

            async def a2a_task() -> None:
                req = send_request(text_message("true"))
                async for ev in client.send_message(req):
                    if ev.task.status.state != pb.TaskState.TASK_STATE_COMPLETED:
                        raise RuntimeError(f"task ended {pb.TaskState.Name(ev.task.status.state)}")

            n = 0

            async def ref_task() -> None:
                req = send_request(text_message("true"))
                async for ev in ref_client.send_message(req):
                    if ev.task.status.state != pb.TaskState.TASK_STATE_COMPLETED:
                        raise RuntimeError(f"task ended {pb.TaskState.Name(ev.task.status.state)}")

            def raw_body() -> dict[str, Any]:
                nonlocal n
                n += 1
                return {
                    "jsonrpc": "2.0",
                    "id": n,
                    "method": "SendMessage",
                    "params": {
                        "message": {
                            "messageId": f"raw-{time.time_ns()}-{n}",
                            "role": "ROLE_USER",
                            "parts": [{"text": "true"}],
                        }
                    },
                }

            async def raw_post(url: str) -> None:
                r = await raw.post(url, json=raw_body())
                state = r.json()["result"]["task"]["status"]["state"]
                if state != "TASK_STATE_COMPLETED":
                    raise RuntimeError(f"task ended {state}")

            async def a2a_raw() -> None:
                """The same call with a bare JSON-RPC POST: the server side of A2A alone."""
                await raw_post(agent_url)

            async def ref_raw() -> None:
                await raw_post(ref_base + "/a2a")

            paths = (
                ("baseline", baseline),
                ("a2a", a2a_task),
                ("a2a_raw", a2a_raw),
                ("sdk_ref", ref_task),
                ("sdk_ref_raw", ref_raw),
            )

            def cpu_now() -> dict[str, float]:
                return {k: cpu_seconds(p) for k, p in pids.items()}

            # warm up every path (connections, caches, the agent's first PTYs)
            for _, op in paths:
                await run_batch(op, 2, 20, 30)
            for conc in CONCURRENCY:
                per: dict[str, tuple[list[float], float, int]] = {
                    name: ([], 0.0, 0) for name, _ in paths
                }
                cpu: dict[str, dict[str, float]] = {
                    name: dict.fromkeys(pids, 0.0) for name, _ in paths
                }
                rounds = 4
                for k in range(rounds):  # alternate batches (ABBA…) to spread drift evenly
                    for name, op in paths if k % 2 == 0 else paths[::-1]:
                        c0 = cpu_now()
                        lat, wall, err = await run_batch(
                            op, conc, args.tasks // rounds, args.seconds / rounds
                        )
                        c1 = cpu_now()
                        for proc_name in pids:
                            cpu[name][proc_name] += c1[proc_name] - c0[proc_name]
                        acc = per[name]
                        per[name] = (acc[0] + lat, acc[1] + wall, acc[2] + err)
                row: dict[str, Any] = {}
                for name, (lat, wall, err) in per.items():
                    ref_path = name.startswith("sdk_ref")
                    row[name] = {
                        "tasks": len(lat),
                        "errors": err,
                        "tasks_per_s": round(len(lat) / wall, 1) if wall else 0.0,
                        "p50_ms": round(pct(lat, 50) * 1000, 2),
                        "p99_ms": round(pct(lat, 99) * 1000, 2),
                        "mean_ms": round(statistics.fmean(lat) * 1000, 2) if lat else None,
                        "server_cpu_ms_per_task": cpu_ms_per_task(
                            cpu[name]["reference" if ref_path else "server"], len(lat)
                        ),
                        "agent_cpu_ms_per_task": None
                        if ref_path
                        else cpu_ms_per_task(cpu[name]["agent"], len(lat)),
                    }
                b, a = row["baseline"], row["a2a"]
                row["a2a_added_p50_ms"] = round(a["p50_ms"] - b["p50_ms"], 2)
                row["ratio_p50"] = round(a["p50_ms"] / b["p50_ms"], 3) if b["p50_ms"] else None
                row["ratio_p99"] = round(a["p99_ms"] / b["p99_ms"], 3) if b["p99_ms"] else None
                row["server_added_p50_ms"] = round(row["a2a_raw"]["p50_ms"] - b["p50_ms"], 2)
                ref = row["sdk_ref"]

                def ratio(x: float | None, y: float | None) -> float | None:
                    return round(x / y, 3) if x is not None and y else None

                row["vs_reference"] = {
                    "tasks_per_s": ratio(a["tasks_per_s"], ref["tasks_per_s"]),
                    "p50": ratio(a["p50_ms"], ref["p50_ms"]),
                    "server_cpu_per_task": ratio(
                        a["server_cpu_ms_per_task"], ref["server_cpu_ms_per_task"]
                    ),
                    "targets": "tasks/s >= 0.9, p50 <= 1.3, server CPU <= 1.5",
                }
                results[f"c{conc}"] = row
            if args.long:
                slices = []
                per_slice = max(1, args.tasks * args.long // 10)
                for _ in range(10):
                    c0 = cpu_now()
                    lat, wall, err = await run_batch(a2a_task, 8, per_slice, args.seconds * 2)
                    c1 = cpu_now()
                    slices.append(
                        {
                            "tasks": len(lat),
                            "errors": err,
                            "tasks_per_s": round(len(lat) / wall, 1) if wall else 0.0,
                            "server_cpu_ms_per_task": cpu_ms_per_task(
                                c1["server"] - c0["server"], len(lat)
                            ),
                        }
                    )
                first = slices[0]["server_cpu_ms_per_task"]
                last = slices[-1]["server_cpu_ms_per_task"]
                results["long"] = {
                    "factor": args.long,
                    "clients": 8,
                    "slices": slices,
                    "last_over_first_cpu": ratio(last, first),
                }
        await http.aclose()
        await raw.aclose()
        if watcher.task is not None:
            watcher.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher.task
    finally:
        if ref_proc is not None:
            ref_proc.terminate()
            ref_proc.wait(10)
        await agent.stop()
        await server.stop()
    results["pinned"] = "servers+agent CPU 0, client CPU 1" if pinned else "no"
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=400, help="tasks per path and concurrency")
    ap.add_argument("--seconds", type=float, default=60.0, help="time limit per path and level")
    ap.add_argument("--binding", default="JSONRPC", choices=("JSONRPC", "HTTP+JSON"))
    ap.add_argument("--long", type=int, default=0, help="then N x the tasks in ten slices")
    ap.add_argument("--no-pin", action="store_true", help="leave the scheduler to place them")
    args = ap.parse_args()
    args.long = max(0, min(args.long, 20))
    load_start = os.getloadavg()
    results = asyncio.run(bench(args))
    load_end = os.getloadavg()
    print()
    print(f"A2A trivial tasks (`true`) via a host-side agent, binding {args.binding}")
    head = (
        f"{'clients':>7} {'path':>11} {'tasks':>6} {'tasks/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'srv CPU/task':>12} {'agent CPU':>9}"
    )
    print(head)
    print("-" * len(head))
    for conc in CONCURRENCY:
        row = results[f"c{conc}"]
        for name in ("baseline", "a2a", "a2a_raw", "sdk_ref", "sdk_ref_raw"):
            r = row[name]
            agent_cpu = r["agent_cpu_ms_per_task"]
            print(
                f"{conc:>7} {name:>11} {r['tasks']:>6} {r['tasks_per_s']:>8} "
                f"{r['p50_ms']:>8} {r['p99_ms']:>8} {r['server_cpu_ms_per_task']!s:>9} ms "
                f"{'-' if agent_cpu is None else agent_cpu:>6} ms"
            )
        v = row["vs_reference"]
        print(
            f"{'':>7} {'vs sdk ref':>11} tasks/s x{v['tasks_per_s']} (>= 0.9), p50 x{v['p50']} "
            f"(<= 1.3), server CPU/task x{v['server_cpu_per_task']} (<= 1.5)"
        )
        print(
            f"{'':>7} {'a2a adds':>9} p50 {row['a2a_added_p50_ms']:+.2f} ms  "
            f"(ratio p50 {row['ratio_p50']}, p99 {row['ratio_p99']}); target <= +5 ms p50"
        )
        print(f"{'':>7} {'server':>9} p50 {row['server_added_p50_ms']:+.2f} ms (a2a_raw: no SDK)")
    long = results.get("long")
    if long:
        cpus = [sl["server_cpu_ms_per_task"] for sl in long["slices"]]
        print(
            f"{long['factor']}x longer at 8 clients, server CPU ms/task per tenth: {cpus} "
            f"(last / first x{long['last_over_first_cpu']}: flat is ~1)"
        )
    loads = " -> ".join(" ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end))
    print(f"pinned: {results['pinned']}")
    print(f"load average start -> end: {loads}")
    out = {
        "benchmark": "a2a",
        "command": "true (bash -lc true in a PTY session)",
        "binding": args.binding,
        "baseline": "POST /api/v2/admin/sessions + session.exited event (agent link, no A2A)",
        "target": "a2a adds <= 5 ms p50",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in load_start],
            "loadavg_at_end": [round(x, 2) for x in load_end],
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }
    path = REPO / "bench-results" / "a2a.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(REPO)}")
    bad = [
        k
        for k, v in results.items()
        if k.startswith("c") and (v["a2a"]["errors"] or v["baseline"]["errors"])
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
