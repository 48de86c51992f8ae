"""A real `sandbox-server` subprocess on free loopback ports with its own data directory.

    server = ServerProcess(tmp_path / "srv", env={"SANDBOX_AGENT_HEARTBEAT_SECONDS": "0.5"})
    server.start()               # waits for /healthz, reads the admin token
    status, body = server.api("GET", "/api/v2/admin/whoami")
    server.kill9(); server.start()   # same ports, same data dir: a crash and a restart
    server.stop()

libvirt is disabled (SANDBOX_LIBVIRT_URI=""). Logs go to `<data_dir>/server.log`. `argv` and
`cwd` run another command in another directory (an installed console script, a copied tree).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from tests.support.lifetime import die_with_parent

ROOT = Path(__file__).resolve().parents[2]


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and never one this process handed out before: servers whose
    ports are all chosen before any of them binds could otherwise get the same one twice (a
    follower's enroll port was the other node's HTTP port)."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no loopback port left that this process has not handed out")


# every server a test started, so a failing test's report can show their logs' tails
STARTED: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


def running_servers() -> list[ServerProcess]:
    return [s for s in STARTED if s.alive()]


class ServerProcess:
    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str] | None = None,
        *,
        wrapper: list[str] | None = None,
        argv: list[str] | None = None,
        cwd: Path | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.wrapper = list(wrapper or [])  # a command the server runs under (e.g. unshare)
        self.argv = argv or [sys.executable, "-m", "agentic_sandbox.broker.main", "serve"]
        self.cwd = cwd or ROOT
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.enroll_port = free_port()
        self.metrics_port = free_port()
        self.guest_port = free_port()
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin_token = ""
        # nodes sharing one data dir (several control hosts) each log apart
        self.log_path = log_path or data_dir / "server.log"
        self.starts = 0

    # ---- addresses ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def enroll_target(self) -> str:
        return f"127.0.0.1:{self.enroll_port}"

    @property
    def guest_link_target(self) -> str:
        return f"127.0.0.1:{self.guest_port}"

    @property
    def ca_path(self) -> Path:
        return self.data_dir / "agent-ca" / "ca.crt"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
        env.update(
            {
                "SANDBOX_DATA_DIR": str(self.data_dir),
                "SANDBOX_HTTP_LISTEN": f"127.0.0.1:{self.http_port}",
                "SANDBOX_GRPC_LISTEN": f"127.0.0.1:{self.grpc_port}",
                "SANDBOX_GRPC_ENROLL_LISTEN": f"127.0.0.1:{self.enroll_port}",
                "SANDBOX_METRICS_LISTEN": f"127.0.0.1:{self.metrics_port}",
                "SANDBOX_GUEST_LINK_LISTEN": f"127.0.0.1:{self.guest_port}",
                "SANDBOX_LIBVIRT_URI": "",
                "SANDBOX_LOG_FORMAT": "json",
                "SANDBOX_SHUTDOWN_GRACE_SECONDS": "2",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> ServerProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        log.write(f"\n---- start {self.starts} ----\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [*self.wrapper, *self.argv],
            cwd=self.cwd,
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        STARTED.add(self)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"sandbox-server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError(f"sandbox-server did not start:\n{self.log_tail()}")
            time.sleep(0.05)
        self.admin_token = (self.data_dir / "admin-token").read_text().strip()
        return self

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Poll `/readyz` until it answers 200 (database and fleet ready); the seconds waited."""
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sandbox-server exited:\n{self.log_tail()}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"sandbox-server not ready after {timeout:.0f}s")
            time.sleep(0.05)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- HTTP ---------------------------------------------------------------------------------
    def api(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        tok = self.admin_token if token is None else token
        if tok:
            req.add_header("Authorization", f"Bearer {tok}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            status = exc.code
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, out = self.api(method, path, body, **kw)
        if status >= 300:
            raise AssertionError(f"{method} {path} -> {status}: {out}")
        return out

    def make_token(self, subject: str, role: str) -> str:
        out = self.ok("POST", "/api/v2/admin/tokens", {"subject": subject, "role": role})
        return str(out["token"])
