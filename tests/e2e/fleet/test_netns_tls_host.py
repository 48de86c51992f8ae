"""A hypervisor reached over ``qemu+tls://``: a private libvirtd in a network namespace the test
makes listens with TLS, its server certificate signed by the server's kind of CA
(`CertificateAuthority.issue_libvirtd`, from a CSR: the key is made on the "host"), and the
fleet connects with a client identity from the same CA in a pkipath directory
(`CertificateAuthority.libvirt_client_credentials`, the files the hosts API writes). The tiny
guest is placed there, its images uploaded over the TLS connection, and reaches the host's
control address. A client whose CA is another one is refused with a reason naming the host and
the certificate, at once: no hang, the host unreachable, nothing placed on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agentic_sandbox.broker.agentlink import CertificateAuthority
from agentic_sandbox.fleet import (
    FleetEventKind,
    HostSpec,
    NoCapacity,
)
from tests.support.control_listener import ControlListener
from tests.support.fleet_real_env import RealEnv, wait_log
from tests.support.netns_fleet import namespace_fleet, tiny_guest_or_fail
from tests.support.netns_libvirt import NamespaceHypervisor

pytestmark = pytest.mark.libvirt_real


def _private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def libvirtd_files(ca: CertificateAuthority, directory: Path, address: str) -> Path:
    """What an operator puts on the libvirtd host: its own key, the certificate the server's
    CA signed from its CSR, and the CA."""
    directory.mkdir(mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    _private(
        directory / "serverkey.pem",
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    (directory / "servercert.pem").write_bytes(ca.issue_libvirtd(csr, [address]))
    (directory / "cacert.pem").write_bytes(ca.certificate_pem)
    return directory


def client_pki(ca: CertificateAuthority, directory: Path) -> Path:
    """The pkipath the hosts API makes for a qemu+tls host on the server's CA."""
    directory.mkdir(mode=0o700)
    key_pem, cert_pem = ca.libvirt_client_credentials()
    (directory / "cacert.pem").write_bytes(ca.certificate_pem)
    (directory / "clientcert.pem").write_bytes(cert_pem)
    _private(directory / "clientkey.pem", key_pem)
    return directory


@pytest.fixture
async def tls_host(
    tmp_path: Path,
) -> AsyncIterator[tuple[RealEnv, NamespaceHypervisor, CertificateAuthority]]:
    guest = tiny_guest_or_fail()
    ca = CertificateAuthority(tmp_path / "agent-ca")
    os.chmod(tmp_path, 0o755)  # libvirtd (root, in its mount namespace) reads its files there
    hv = NamespaceHypervisor("tls")  # its address is chosen now, the namespace made on entry
    hv.tls_dir = libvirtd_files(ca, tmp_path / "libvirtd-tls", hv.address)
    with hv as h:
        pki = client_pki(ca, tmp_path / "client-pki")
        async with namespace_fleet(h, guest, "tls", h.tls_uri, tls_pki_dir=str(pki)) as env:
            yield env, h, ca


async def test_a_guest_is_placed_on_a_host_reached_over_tls(
    tls_host: tuple[RealEnv, NamespaceHypervisor, CertificateAuthority],
) -> None:
    env, h, _ = tls_host
    f = env.fleet
    # the daemon listens with TLS (and the clean-up's tcp) on the namespace address only
    assert h.listening() == [f"{h.address}:16509", f"{h.address}:16514"]
    gateway = ControlListener(h.control_address)
    try:
        inst = await f.create(
            env.spec("tls-1", agent_port=gateway.port, cmdline=f"sbx.probe={gateway.port}")
        )
        assert inst.host == "tls"
        _, log = await wait_log(f, "tls-1", rb"SBX-TICK 1\b", timeout=120)  # a TLS stream
        assert f"SBX-PROBE {gateway.port} ok".encode() in log, (log[-600:], gateway.received)
        assert any(peer == h.address and b"hello-from-guest" in d for peer, d in gateway.received)
    finally:
        gateway.close()


async def test_a_client_of_another_ca_is_refused_naming_the_host(
    tls_host: tuple[RealEnv, NamespaceHypervisor, CertificateAuthority],
    tmp_path: Path,
) -> None:
    env, h, _ = tls_host
    f = env.fleet
    other = CertificateAuthority(tmp_path / "other-ca")
    wrong = client_pki(other, tmp_path / "wrong-pki")
    started = time.monotonic()
    info = await f.add_host(
        HostSpec(
            name="wrong-ca",
            uri=h.tls_uri,
            tls_pki_dir=str(wrong),
            accel="tcg",
            files="remote",
            data_dir=h.data_dir + "-wrong",
        )
    )
    try:
        assert time.monotonic() - started < 20  # refused, not a hang
        assert not info.reachable
        assert "certificate" in info.reason.lower(), info.reason
        said = [
            e.detail
            for e in env.events
            if e.kind is FleetEventKind.HOST_UNREACHABLE and e.host == "wrong-ca"
        ]
        assert said and "wrong-ca" in said[0] and "certificate" in said[0].lower(), said
        with pytest.raises(NoCapacity, match="wrong-ca"):
            await f.create(env.spec("tls-wrong", host="wrong-ca"))
        assert "tls-wrong" not in f.index
        assert (await f.host_info("tls")).reachable  # the right client still is
    finally:
        await f.remove_host("wrong-ca", force=True)
