"""The agent's key pair and certificate request, made by the `openssl` command.

The agent installs into a guest with grpcio, protobuf and ptyprocess only (no `cryptography`),
so it does not link a crypto library of its own. Every Debian image has the `openssl` command
(`ca-certificates` depends on it): one `openssl req -newkey ec` makes an ECDSA P-256 key
(PKCS#8 PEM, what gRPC loads) and a PKCS#10 request signed by it, in constant-time, reviewed
code. The key travels over a pipe to this process and is only ever written 0600. Every TLS
handshake afterwards is gRPC's BoringSSL with that key.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

_PEM = re.compile(rb"-----BEGIN ([A-Z ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.S)
_CN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class PkiError(RuntimeError):
    """A key or request could not be made; the message says why."""


def new_key_and_csr(common_name: str, *, timeout: float = 60) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 private key (PKCS#8 PEM) and a CSR for it naming `common_name`
    (the server ignores the subject and names the certificate after the enrolled instance)."""
    if not _CN.fullmatch(common_name):
        raise PkiError(f"not a usable common name: {common_name!r}")
    exe = shutil.which("openssl")
    if exe is None:
        raise PkiError("the openssl command is needed to make the agent's key; install openssl")
    argv = [
        exe, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", "-", "-subj", f"/CN={common_name}", "-sha256",
    ]  # fmt: skip
    try:
        res = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise PkiError(f"openssl could not run: {exc}") from None
    blocks = {m.group(1): m.group(0) for m in _PEM.finditer(res.stdout)}
    key, csr = blocks.get(b"PRIVATE KEY"), blocks.get(b"CERTIFICATE REQUEST")
    if res.returncode != 0 or key is None or csr is None:
        why = res.stderr.decode(errors="replace").strip().splitlines()
        raise PkiError(
            f"openssl req failed (exit {res.returncode}): {why[-1] if why else 'no output'}"
        )
    return key, csr


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only (0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
