"""Test hosts in network namespaces the test makes itself (never any other address).

    with NamespaceHost("a") as host:        # a netns, a veth pair, 10.231.N.2 inside
        host.serve_http(8080, "hello")      # python3 -m http.server inside it
        host.serve_https(8443, cert, key, "hello")  # HTTPS (a test's own cert; /bytes/N too)
        host.serve_https(8443, cert, key, "hello", require=("Authorization", "Bearer x"))
                                            # /brokered answers 200 only with that header
        host.address                        # what the host side reaches it at

Each host gets a /30 of 10.231.0.0/16 of its own (the host side .1, the namespace .2), chosen
from this process's id so parallel runs do not collide; everything is removed on exit (the
servers by their process ids, then `ip netns del`, which takes the veth pair with it).
Needs root (`ip netns`).
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.lifetime import die_with_parent

_count = itertools.count()

HTTPS_SERVER = r"""
import http.server, ssl, sys
addr, port, cert, key, text = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
need = (sys.argv[6], sys.argv[7]) if len(sys.argv) > 7 else None
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path.startswith("/brokered"):  # checks the header a brokered credential sets
            got = self.headers.get_all(need[0]) if need else None
            ok = need is not None and got == [need[1]]
            body = b"credential ok\n" if ok else f"credential wrong: {len(got or [])}\n".encode()
            self.send_response(200 if ok else 401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path.startswith("/bytes/"):  # N zero bytes (benchmarks)
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("content-length", str(n))
            self.end_headers()
            chunk = bytes(65536)
            while n > 0:
                self.wfile.write(chunk[: min(n, len(chunk))])
                n -= len(chunk)
            return
        body = (text + " " + self.path + "\n").encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer((addr, port), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"""


def make_cert(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA of the test's own and a server certificate for `name` signed by it (ca, cert, key)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = (tmp / "ca.pem", tmp / "server.pem", tmp / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class NamespaceHost:
    """``network`` is the /16 the /30s come from; ``tag`` tells this use's netns and
    interface names from other tests' (egress: 10.231, "e"; hypervisor hosts: 198.18, "h")."""

    def __init__(self, label: str, *, network: str = "10.231", tag: str = "e") -> None:
        n = next(_count)
        slot = (os.getpid() * 7 + n) % 16000
        self.name = f"sbxeg-{os.getpid()}-{n}" if tag == "e" else f"sbx{tag}-{os.getpid()}-{n}"
        self.host_if = f"sbx{tag}{slot}h"
        self.ns_if = f"sbx{tag}{slot}n"
        base = 4 * slot
        self.host_address = f"{network}.{base // 256}.{base % 256 + 1}"
        self.address = f"{network}.{base // 256}.{base % 256 + 2}"
        self.label = label
        self._procs: list[subprocess.Popen[bytes]] = []
        self._tmp = Path(tempfile.mkdtemp(prefix=f"netns-{label}-"))

    def __enter__(self) -> NamespaceHost:
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{self.address}/30", "dev", self.ns_if)
            _ip("-n", self.name, "link", "set", self.ns_if, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _run(self, argv: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self._procs.append(proc)
        return proc

    def _wait_listening(self, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((self.address, port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing listens on {self.address}:{port}") from None
                time.sleep(0.05)

    def serve_http(self, port: int, text: str) -> None:
        """`python3 -m http.server` inside, serving `index.html` = text."""
        root = self._tmp / f"http-{port}"
        root.mkdir()
        (root / "index.html").write_text(text + "\n")
        self._run(
            [
                sys.executable,
                "-m",
                "http.server",
                "--bind",
                self.address,
                "-d",
                str(root),
                str(port),
            ]
        )
        self._wait_listening(port)

    def serve_https(
        self, port: int, cert: Path, key: Path, text: str, require: tuple[str, str] | None = None
    ) -> None:
        """HTTPS on `port`; with `require` (header, value) `/brokered` answers 200 only when the
        request carries exactly that header (401 otherwise, never echoing a value)."""
        argv = [sys.executable, "-c", HTTPS_SERVER, self.address, str(port), str(cert), str(key)]
        self._run([*argv, text, *(require or ())])
        self._wait_listening(port)
