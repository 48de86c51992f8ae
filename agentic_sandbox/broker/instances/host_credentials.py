"""The files a remote host's libvirt connection reads: kept under
``<data_dir>/host-credentials/<host>/`` (folders 0700, keys 0600), never in API answers, logs,
events or the hosts table (which keeps only which kind of credential a host uses and, for SSH,
the name of the vault secret holding its key).

- ``qemu+tls`` with the server's CA (the default): ``tls/`` holds ``cacert.pem`` (the server's
  CA, `<data_dir>/agent-ca`), ``clientcert.pem`` and ``clientkey.pem``, a libvirt client identity
  the CA issues (CN ``agentic-sandbox-server``), re-issued when missing, not from the current CA
  or within 30 days of its end. The libvirtd host gets its server certificate from the same CA
  by sending a CSR (``POST /api/v2/admin/hosts/libvirtd-certificate``, ``sandboxctl host
  libvirtd-cert``): its key never leaves it.
- ``qemu+tls`` with the operator's PKI: ``tls_pki_dir`` names a directory on this machine with
  the same three files; the server only checks that they are there.
- ``qemu+ssh``: the private key is a vault secret of the operator who adds the host
  (``ssh_key_secret``); it is written to ``ssh/id`` (0600) for libvirt's libssh2 transport, which
  reads it on every (re)connect, and removed with the host. ``ssh/known_hosts`` holds the
  entries the operator gave; empty, the first connection records the key the host shows and
  later connections are checked against it (`fleet.host_uri`).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import os
import shutil
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agentic_sandbox.broker.agentlink import CertificateAuthority
from agentic_sandbox.broker.instances.errors import InvalidInput
from agentic_sandbox.broker.secrets.vault import Vault
from agentic_sandbox.fleet import missing_tls_files

RENEW_BEFORE = dt.timedelta(days=30)
KNOWN_HOST_KEY_TYPES = frozenset(
    {
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)
MAX_KNOWN_HOSTS = 64 * 1024


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def check_known_hosts(text: str) -> str:
    """OpenSSH known_hosts lines (``host[,host] keytype base64``), normalised; InvalidInput
    naming the line otherwise."""
    if len(text) > MAX_KNOWN_HOSTS:
        raise InvalidInput("ssh_known_hosts", "too long")
    lines = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if fields[0].startswith("@"):  # @cert-authority / @revoked markers
            fields = fields[1:]
        ok = len(fields) >= 3 and fields[1] in KNOWN_HOST_KEY_TYPES and line.isprintable()
        if ok:
            try:
                base64.b64decode(fields[2], validate=True)
            except (binascii.Error, ValueError):
                ok = False
        if not ok:
            raise InvalidInput(
                "ssh_known_hosts", f"line {n} is not a known_hosts entry (host keytype base64)"
            )
        lines.append(line)
    return "".join(f"{line}\n" for line in lines)


def _check_private_key(value: str) -> bytes:
    data = value.strip().encode() + b"\n"
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            serialization.load_ssh_private_key(data, password=None)
        else:
            serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidInput(
            "ssh_key_secret",
            "the secret is not an unencrypted private key (OpenSSH or PEM)",
        ) from None
    return data


class HostCredentials:
    def __init__(self, data_dir: Path, vault: Vault) -> None:
        self.root = data_dir / "host-credentials"
        self._ca_dir = data_dir / "agent-ca"
        self._vault = vault
        self._ca: CertificateAuthority | None = None

    def _host_dir(self, name: str) -> Path:
        _private_dir(self.root)
        return _private_dir(self.root / name)

    @property
    def ca(self) -> CertificateAuthority:
        if self._ca is None:
            self._ca = CertificateAuthority(self._ca_dir)
        return self._ca

    # ---- qemu+tls ---------------------------------------------------------------------------
    def server_ca_pki(self, name: str) -> str:
        """The pki directory for a ``qemu+tls`` host on the server's CA (made or renewed)."""
        d = _private_dir(self._host_dir(name) / "tls")
        ca = self.ca
        cacert = d / "cacert.pem"
        if not cacert.exists() or cacert.read_bytes() != ca.certificate_pem:
            _write(cacert, ca.certificate_pem, 0o644)
        if self._needs_client_cert(d / "clientcert.pem", ca):
            key_pem, cert_pem = ca.libvirt_client_credentials()
            _write(d / "clientkey.pem", key_pem, 0o600)
            _write(d / "clientcert.pem", cert_pem, 0o644)
        return str(d)

    @staticmethod
    def _needs_client_cert(path: Path, ca: CertificateAuthority) -> bool:
        if not path.exists() or not (path.parent / "clientkey.pem").exists():
            return True
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
            ca.verify_issued(cert)
        except Exception:  # unreadable or from another CA: issue a new one
            return True
        return cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < RENEW_BEFORE

    @staticmethod
    def check_operator_pki(path: str) -> str:
        if not os.path.isabs(path) or not os.path.isdir(path):
            raise InvalidInput("tls_pki_dir", "must be an existing directory on the server")
        missing = missing_tls_files(path)
        if missing:
            raise InvalidInput("tls_pki_dir", f"the directory lacks {', '.join(missing)}")
        return os.path.normpath(path)

    # ---- qemu+ssh ---------------------------------------------------------------------------
    def ssh_paths(self, name: str) -> tuple[str, str]:
        """Where a ``qemu+ssh`` host's key and known_hosts are (written by `ssh_files`)."""
        d = self.root / name / "ssh"
        return str(d / "id"), str(d / "known_hosts")

    async def ssh_files(
        self, name: str, owner: str, secret: str, known_hosts: str | None
    ) -> tuple[str, str]:
        """Write the host's key (from the vault) and known_hosts; their paths."""
        known_text = check_known_hosts(known_hosts) if known_hosts is not None else None
        value = await self._vault.value_of(owner, secret)
        if value is None:
            raise InvalidInput("ssh_key_secret", f"no secret named {secret!r} (put it first)")
        key = _check_private_key(value)
        d = _private_dir(self._host_dir(name) / "ssh")
        _write(d / "id", key, 0o600)
        kh = d / "known_hosts"
        if known_text is not None:
            _write(kh, known_text.encode(), 0o600)
        elif not kh.exists():
            _write(kh, b"", 0o600)  # trust on first use: the first connection records the key
        return self.ssh_paths(name)

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)
