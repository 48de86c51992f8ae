"""gRPC's C-core log lines (a failed TLS handshake on the agent link) come out of the server as
its own log records — JSON or text, as configured — never as raw abseil lines."""

from __future__ import annotations

import json
import socket
import ssl
import time
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

RAW = "ssl_transport_security.cc:"


def fail_handshakes(server: ServerProcess) -> None:
    """A plain-text request, and a TLS client with no certificate, to the mTLS agent link."""
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(100)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw) as tls:
                tls.sendall(b"x")
                tls.recv(100)
        except (ssl.SSLError, OSError):
            pass  # refused: what this test wants


def wait_log(server: ServerProcess, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log := server.log_text()):
        assert time.monotonic() < deadline, f"no {text!r} in the server log:\n{log[-3000:]}"
        time.sleep(0.1)
    return log


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_failed_tls_handshake_is_a_structured_log_line(tmp_path: Path, fmt: str) -> None:
    server = ServerProcess(tmp_path / "srv", env={"SANDBOX_LOG_FORMAT": fmt})
    server.start()
    try:
        fail_handshakes(server)
        # the second refusal's line (each is relayed on its own: waiting for the first alone
        # could stop the server before the second is written)
        log = wait_log(server, "PEER_DID_NOT_RETURN_A_CERTIFICATE")
    finally:
        server.stop()
    lines = [line for line in log.splitlines() if "Handshake failed" in line]
    assert lines and not any(RAW in line and not line.startswith("{") for line in lines), lines
    if fmt == "json":
        records = [json.loads(line) for line in lines]
        assert all(r["logger"] == "grpc.core" and r["level"] == "info" for r in records), records
        assert all(r["source"].startswith(RAW) for r in records), records
        assert any("PEER_DID_NOT_RETURN_A_CERTIFICATE" in r["msg"] for r in records), records
    else:
        assert all(" INFO    grpc.core: Handshake failed" in line for line in lines), lines
