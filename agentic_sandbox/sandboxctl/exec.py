"""`sandboxctl instance exec ID [--timeout S] [--memory MiB] [--cpus N] [--pids N] -- CMD ARGS…`

Runs the command through the server's streaming exec route (`…/exec/stream`, NDJSON) and
writes its stdout and stderr to this terminal's own streams as they come (exact bytes:
the route is asked for base64). The exit status is the command's (128 + N when signal N ended
it); when a budget ended it, the reason is said on stderr. `--stdin` sends this process's
standard input (up to the server's limit) to the command.

With `-o json|yaml` the command runs through the JSON route instead and its whole answer is
printed when it ends (stdout and stderr as text, up to the server's limits; exit code,
reason, duration, usage — with its egress bytes — and budget); the exit status is still the
command's.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
from typing import Any

from agentic_sandbox.sandboxctl.exits import EXIT_ERROR, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from agentic_sandbox.sandboxctl.output import emit
from agentic_sandbox.sandboxctl.parsing import kv
from agentic_sandbox.sdk import AsyncClient
from agentic_sandbox.sdk.fleet import ExecOptions


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


def exit_status(line: dict[str, Any]) -> int:
    code = line.get("exit_code")
    if isinstance(code, int):
        return code
    name = str(line.get("signal") or "KILL")
    try:
        return 128 + int(signal.Signals[f"SIG{name}"])
    except KeyError:
        return EXIT_ERROR


async def instance_exec(c: AsyncClient, a: argparse.Namespace) -> int:
    if not a.command:
        raise CliError("give the command after --: instance exec ID -- CMD ARGS…", EXIT_USAGE)
    options: ExecOptions = {
        "stdin": sys.stdin.buffer.read() if a.stdin else None,
        "env": kv(a.env or [], "--env"),
        "cwd": a.cwd,
        "user": a.user,
        "timeout_seconds": a.timeout,
        "memory_mib": a.memory,
        "cpus": a.cpus,
        "pids": a.pids,
        "output_bytes": a.output_bytes,
    }
    if getattr(a, "output", "table") in ("json", "yaml"):
        answer = (await c.instances.exec(a.id, a.command, **options)).to_dict()
        emit(answer, a.output)
        return exit_status(answer)
    out, err = sys.stdout.buffer, sys.stderr.buffer
    lines = c.instances.exec_stream(a.id, a.command, **options)
    async for line in lines:
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
    raise CliError("the server ended the stream before the command's exit", EXIT_UNAVAILABLE)
