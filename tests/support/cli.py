"""Run `sandboxctl` as a user does: a subprocess, its config under the test's tmp dir (never
the repo), its working directory there too.

    ctl = Sandboxctl(server.url, server.admin_token, tmp_path)
    res = ctl("instance", "list", "-o", "json")      # a CompletedProcess
    doc = ctl.json("whoami")                          # exit 0 asserted, stdout parsed
    code, out, err = await ctl.run_async("image", "build", "x")   # for in-process servers
    code, out, err = await ctl.run_inprocess_async("whoami")      # main() here, no process

A process start costs about a second (the interpreter and the CLI's imports); a test that runs
dozens of verbs runs most of them with `run_inprocess*` — the same `main()` with the same argv
and environment, stdin /dev/null, stdout and stderr pipes rather than terminals — and keeps
real subprocess runs of its own.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from agentic_sandbox.sandboxctl.main import main

ARGV = [sys.executable, "-m", "agentic_sandbox.sandboxctl.main"]
_INPROCESS = threading.Lock()  # one in-process run at a time: it swaps the process's env and stdio


class Sandboxctl:
    def __init__(self, url: str, token: str | None, home: Path, **env: str) -> None:
        self.url = url
        self.token = token
        self.home = home
        self.home.mkdir(parents=True, exist_ok=True)
        self.extra_env = env

    def environment(self, token: str | None = None, **env: str) -> dict[str, str]:
        out = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
        out.update({"SANDBOX_URL": self.url, "XDG_CONFIG_HOME": str(self.home)})
        tok = token if token is not None else self.token
        if tok:
            out["SANDBOX_TOKEN"] = tok
        out.update(self.extra_env)
        out.update(env)
        return {k: v for k, v in out.items() if v != ""}

    def __call__(
        self,
        *args: str,
        token: str | None = None,
        timeout: float = 120,
        stdin: str | None = None,
        **env: str,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*ARGV, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.environment(token, **env),
            cwd=self.home,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
        )

    def json(self, *args: str, **kw: Any) -> Any:
        res = self(*args, "-o", "json", **kw)
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        return json.loads(res.stdout)

    async def run_async(
        self, *args: str, token: str | None = None, timeout: float = 120, **env: str
    ) -> tuple[int, str, str]:
        """For a server running in the test's own event loop (a blocking run would stall it)."""
        proc = await asyncio.create_subprocess_exec(
            *ARGV,
            *args,
            env=self.environment(token, **env),
            cwd=self.home,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    def run_inprocess(
        self, *args: str, token: str | None = None, **env: str
    ) -> tuple[int, str, str]:
        """`main(args)` in this process as `python -m ...sandboxctl.main` would run it: the
        subprocess's environment (os.environ swapped for the run), stdin /dev/null, stdout and
        stderr captured (no terminal), its exit status (SystemExit's code; an uncaught
        exception is 1 with its traceback on stderr, as the interpreter does). Not for verbs
        that replace the process (`instance ssh` execs ssh)."""
        assert not ("instance" in args and "ssh" in args), "instance ssh execs: a subprocess"
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        with _INPROCESS, open(os.devnull) as stdin:
            saved_env = dict(os.environ)
            saved_io = sys.stdin, sys.stdout, sys.stderr
            os.environ.clear()
            os.environ.update(self.environment(token, **env))
            sys.stdin, sys.stdout, sys.stderr = stdin, out, err
            try:
                try:
                    code = main(list(args))
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    if isinstance(exc.code, str):
                        print(exc.code, file=sys.stderr)
                except Exception:
                    traceback.print_exc()
                    code = 1
            finally:
                sys.stdin, sys.stdout, sys.stderr = saved_io
                os.environ.clear()
                os.environ.update(saved_env)
        out.flush()
        err.flush()
        return (
            code,
            out.buffer.getvalue().decode(),  # type: ignore[attr-defined]
            err.buffer.getvalue().decode(),  # type: ignore[attr-defined]
        )

    async def run_inprocess_async(
        self, *args: str, token: str | None = None, **env: str
    ) -> tuple[int, str, str]:
        """`run_inprocess` in a worker thread (main() runs its own event loop; a server in the
        test's loop keeps serving)."""
        return await asyncio.to_thread(self.run_inprocess, *args, token=token, **env)
