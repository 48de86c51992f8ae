"""The agent's credentials: its key and certificate (0600, in the state dir), the server's CA,
and what the certificate is for. Only the standard library and grpcio."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import grpc

from agentic_sandbox.agent import pki
from agentic_sandbox.agent.config import AgentConfig


class CredentialsMissing(Exception):
    """There is no CA certificate to verify the server with."""


class Credentials:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg

    @staticmethod
    def _read(path: os.PathLike[str] | str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def ca_pem(self) -> bytes:
        """The CA that signed the server: the one enrollment gave, else the configured one."""
        if self.cfg.ca_path.exists():
            return self._read(self.cfg.ca_path)
        if self.cfg.ca_cert is None:
            raise CredentialsMissing("no CA certificate: set ca_cert (the server's agent-link CA)")
        return self._read(self.cfg.ca_cert)

    def meta(self) -> dict[str, Any]:
        try:
            meta: dict[str, Any] = json.loads(self.cfg.cert_meta_path.read_text())
        except (OSError, ValueError):
            return {}
        return meta

    def enrolled(self) -> bool:
        """A key and a certificate of this instance that is still valid for a while."""
        meta = self.meta()
        return (
            self.cfg.key_path.exists()
            and self.cfg.cert_path.exists()
            and meta.get("instance_id") == self.cfg.instance_id
            and float(meta.get("not_after", 0)) > time.time() + 5
        )

    def renew_due(self) -> float:
        """When the certificate should be renewed (a third of its lifetime before it ends)."""
        meta = self.meta()
        issued = float(meta.get("issued_at", time.time()))
        not_after = float(meta.get("not_after", 0))
        return not_after - max(1.0, not_after - issued) / 3

    def store(self, key_pem: bytes, cert_pem: bytes, ca_pem: bytes, not_after: int) -> None:
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):
            os.chmod(self.cfg.state_dir, 0o700)
        pki.write_private(self.cfg.key_path, key_pem)
        pki.write_private(self.cfg.cert_path, cert_pem)
        if ca_pem:
            pki.write_private(self.cfg.ca_path, ca_pem)
        meta = {
            "instance_id": self.cfg.instance_id,
            "issued_at": time.time(),
            "not_after": not_after,
        }
        pki.write_private(self.cfg.cert_meta_path, json.dumps(meta).encode())

    def forget(self) -> None:
        """Drop the key and certificate (they were another instance's)."""
        for path in (self.cfg.key_path, self.cfg.cert_path, self.cfg.cert_meta_path):
            with contextlib.suppress(OSError):
                path.unlink()

    def channel_credentials(self, *, client_cert: bool) -> grpc.ChannelCredentials:
        if client_cert:
            return grpc.ssl_channel_credentials(
                root_certificates=self.ca_pem(),
                private_key=self._read(self.cfg.key_path),
                certificate_chain=self._read(self.cfg.cert_path),
            )
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem())
