"""The real `sandbox-server` process: banner, probes, JSON logs, graceful shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.inproc_server import free_port

SERVER = [sys.executable, "-m", "agentic_sandbox.broker.main"]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError("server did not become ready")


def start(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")} | {
        "SANDBOX_DATA_DIR": str(tmp_path / "data"),
        "SANDBOX_HTTP_LISTEN": f"127.0.0.1:{port}",
        # every listener on a port of its own: a server of command one may hold the defaults
        "SANDBOX_GRPC_LISTEN": f"127.0.0.1:{free_port()}",
        "SANDBOX_GRPC_ENROLL_LISTEN": f"127.0.0.1:{free_port()}",
        "SANDBOX_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
        "SANDBOX_GUEST_LINK_LISTEN": f"127.0.0.1:{free_port()}",
        "SANDBOX_LIBVIRT_URI": "",
        **env,
    }
    proc = subprocess.Popen(
        SERVER, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    return proc, f"http://127.0.0.1:{port}"


def test_banner_probes_and_sigterm_drain(tmp_path: Path) -> None:
    proc, url = start(tmp_path)
    try:
        ready = wait_ready(url, proc)
        assert ready["status"] == "ready" and ready["checks"]["database"]["ok"]
        token_file = tmp_path / "data" / "admin-token"
        token = token_file.read_text().strip()
        # a long-lived SSE stream is open while we ask the server to stop
        req = urllib.request.Request(
            url + "/api/v1/events/stream", headers={"Authorization": f"Bearer {token}"}
        )
        stream = urllib.request.urlopen(req, timeout=10)
        assert stream.status == 200
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, err.decode()[-2000:]
        assert elapsed < 5, f"shutdown took {elapsed:.1f}s with an open stream"
        # Reading to the end returns only because the server closed the stream (a stream left
        # open would raise TimeoutError after the 10 s read timeout).
        stream.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode()
    assert f"dashboard:   {url}/" in text
    assert f"admin token written to {token_file}" in text
    # logs are JSON lines with correlation ids
    lines = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    requests = [entry for entry in lines if entry.get("logger") == "broker.http"]
    assert requests and all("correlation_id" in entry for entry in requests)
    assert token not in err.decode()


def test_second_start_reuses_token_and_data(tmp_path: Path) -> None:
    proc, url = start(tmp_path)
    wait_ready(url, proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=20)
    first = (tmp_path / "data" / "admin-token").read_text()
    proc, url = start(tmp_path)
    try:
        wait_ready(url, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert (tmp_path / "data" / "admin-token").read_text() == first
    assert b"admin token: in " in out


def test_sqlite_is_single_node_and_refuses_a_second_server(tmp_path: Path) -> None:
    proc, url = start(tmp_path, SANDBOX_NODE_NAME="alpha")
    try:
        ready = wait_ready(url, proc)
        assert ready["role"] == "single-node" and ready["node"] == "alpha"
        assert ready["leader"] == {"node": "alpha", "url": url} and "term" not in ready
        # a second server on the same data dir stops before touching the database
        second, _ = start(tmp_path, SANDBOX_NODE_NAME="beta")
        _, err = second.communicate(timeout=60)
        assert second.returncode == 1, err.decode()[-2000:]
        last = err.decode().strip().splitlines()[-1]
        assert last.startswith("sandbox-server: start-up failed:"), last
        assert "in use by another sandbox-server" in last
        assert f"node alpha, pid {proc.pid}, {url}" in last
        assert str(tmp_path / "data" / "server.lock") in last
        assert wait_ready(url, proc)["status"] == "ready"  # the first one is untouched
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "node:        alpha, single-node (SQLite" in out.decode()
    # stopped, it lets the next one in
    proc, url = start(tmp_path, SANDBOX_NODE_NAME="beta")
    try:
        assert wait_ready(url, proc)["node"] == "beta"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)


def test_unreachable_database_fails_startup_clearly(tmp_path: Path) -> None:
    proc, _ = start(
        tmp_path, SANDBOX_DATABASE_URL=f"postgresql+asyncpg://u:p@127.0.0.1:{free_port()}/x"
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("sandbox-server: start-up failed:"), last
    assert "database postgresql+asyncpg://u:***@127.0.0.1" in last
    assert "refused" in last.lower()


def test_bad_config_exits_2_naming_key(tmp_path: Path) -> None:
    proc, _ = start(tmp_path, SANDBOX_HTTP_LISTEN="nowhere")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert b"http_listen" in err and b"SANDBOX_HTTP_LISTEN" in err


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, _ = start(tmp_path, SANDBOX_HTTP_LISTEN=f"127.0.0.1:{port}")
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    last = err.decode().strip().splitlines()[-1]
    expected = f"cannot listen on 127.0.0.1:{port} (HTTP): Address already in use"
    assert last == f"sandbox-server: start-up failed: {expected}", last
