"""Run `sandboxctl` as a user does: a subprocess, its config under the test's tmp dir (never
the repo), its working directory there too.

    ctl = Sandboxctl(server.url, server.admin_token, tmp_path)
    res = ctl("instance", "list", "-o", "json")      # a CompletedProcess
    doc = ctl.json("whoami")                          # exit 0 asserted, stdout parsed
    code, out, err = await ctl.run_async("image", "build", "x")   # for in-process servers
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ARGV = [sys.executable, "-m", "agentic_sandbox.sandboxctl.main"]


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
