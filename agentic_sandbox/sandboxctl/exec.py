"""`sandboxctl instance exec ID [--timeout S] [--memory MiB] [--cpus N] [--pids N] -- CMD ARGS…`

Runs the command through the server's streaming exec route (`…/exec/stream`, NDJSON) and
writes its stdout and stderr to this terminal's own streams as they come (exact bytes:
the route is asked for base64). The exit status is the command's (128 + N when signal N ended
it); when a budget ended it, the reason is said on stderr. `--stdin` sends this process's
standard input (up to the server's limit) to the command.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
from typing import Any

import aiohttp

from agentic_sandbox.sandboxctl.client import (
    EXIT_ERROR,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Api,
    CliError,
    refusal,
)

NO_READ_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("id")
    v.add_argument("--timeout", type=float, help="wall-clock seconds")
    v.add_argument("--memory", type=int, help="memory maximum, MiB")
    v.add_argument("--cpus", type=float, help="CPU quota (1.5 = one and a half CPUs)")
    v.add_argument("--pids", type=int, help="processes and threads at once")
    v.add_argument("--output-bytes", type=int, help="stdout + stderr the command may write")
    v.add_argument("--env", action="append", help="KEY=VALUE (repeatable)")
    v.add_argument("--cwd", help="working directory (absolute)")
    v.add_argument("--user", help="user to run as")
    v.add_argument("--stdin", action="store_true", help="send this standard input to it")
    v.add_argument("command", nargs="*")


def request_body(a: argparse.Namespace) -> dict[str, Any]:
    if not a.command:
        raise CliError("give the command after --: instance exec ID -- CMD ARGS…", EXIT_USAGE)
    budget = {
        key: value
        for key, value in (
            ("timeout_seconds", a.timeout),
            ("memory_mib", a.memory),
            ("cpus", a.cpus),
            ("pids", a.pids),
            ("output_bytes", a.output_bytes),
        )
        if value is not None
    }
    body: dict[str, Any] = {"argv": a.command, "budget": budget, "output_encoding": "base64"}
    env = {}
    for pair in a.env or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--env must be KEY=VALUE, got {pair!r}", EXIT_USAGE)
        env[key] = value
    if env:
        body["env"] = env
    if a.cwd:
        body["cwd"] = a.cwd
    if a.user:
        body["user"] = a.user
    if a.stdin:
        body["stdin_base64"] = base64.b64encode(sys.stdin.buffer.read()).decode()
    return body


def exit_status(line: dict[str, Any]) -> int:
    code = line.get("exit_code")
    if isinstance(code, int):
        return code
    name = str(line.get("signal") or "KILL")
    try:
        return 128 + int(signal.Signals[f"SIG{name}"])
    except KeyError:
        return EXIT_ERROR


async def instance_exec(api: Api, a: argparse.Namespace) -> int:
    body = request_body(a)
    url = api.target.url.rstrip("/") + f"/api/v2/admin/instances/{a.id}/exec/stream"
    out, err = sys.stdout.buffer, sys.stderr.buffer
    try:
        async with api.session.post(
            url, json=body, headers=api.headers(), timeout=NO_READ_TIMEOUT
        ) as resp:
            if resp.status >= 400:
                raw = await resp.read()
                raise refusal(resp.status, raw)
            async for raw_line in resp.content:
                line = json.loads(raw_line)
                kind = line.get("type")
                if kind in ("stdout", "stderr"):
                    target = out if kind == "stdout" else err
                    target.write(base64.b64decode(line["data"]))
                    target.flush()
                elif kind == "exit":
                    if line.get("reason"):
                        usage = line.get("usage") or {}
                        print(
                            f"sandboxctl: the command was ended: {line['reason']} "
                            f"(budget {json.dumps(line.get('budget'))}; used "
                            f"{usage.get('cpu_seconds')} s CPU, "
                            f"{usage.get('peak_memory_bytes')} bytes peak memory)",
                            file=sys.stderr,
                        )
                    return exit_status(line)
                elif kind == "error":
                    raise CliError(str(line.get("detail")), EXIT_UNAVAILABLE)
    except aiohttp.ClientConnectorError as exc:
        raise CliError(
            f"cannot reach the server at {api.target.url}: {exc.os_error}", EXIT_UNAVAILABLE
        ) from None
    raise CliError("the server ended the stream before the command's exit", EXIT_UNAVAILABLE)
