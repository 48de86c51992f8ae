"""`sandboxctl host libvirtd-cert` makes a libvirtd's TLS key where it runs, gets the
certificate from the server's CA by CSR and writes libvirtd's three files; `host add` takes the
credential options of qemu+tls and qemu+ssh hosts."""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agentic_sandbox.broker.instances import FleetComponent
from tests.support.cli import Sandboxctl
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import node_uri


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Running]:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        yield r


async def test_libvirtd_cert_writes_a_local_key_and_the_cas_certificate(
    server: Running, tmp_path: Path
) -> None:
    cli = Sandboxctl(server.url, server.admin_token, tmp_path / "cli")
    out = tmp_path / "libvirt-pki"
    code, _, err = await cli.run_async(
        "host", "libvirtd-cert", "198.18.0.2", "h1.example", "--out", str(out)
    )
    assert code == 0, err
    assert "serverkey.pem" in err and "listen_tls" in err, err
    key_file = out / "serverkey.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key: Any = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    cert = x509.load_pem_x509_certificate((out / "servercert.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((out / "cacert.pem").read_bytes())
    assert (
        ca.public_bytes(serialization.Encoding.PEM)
        == (tmp_path / "data" / "agent-ca" / "ca.crt").read_bytes()
    )
    cert.verify_directly_issued_by(ca)
    assert cert.public_key() == key.public_key()
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("198.18.0.2")]
    before = key_file.read_bytes()
    code, _, err = await cli.run_async("host", "libvirtd-cert", "198.18.0.2", "--out", str(out))
    assert code != 0 and "--force" in err, err
    assert key_file.read_bytes() == before  # an existing key is never overwritten silently
    other = tmp_path / "other"
    code, _, err = await cli.run_async("host", "libvirtd-cert", "bad name!", "--out", str(other))
    assert code != 0 and "names" in err, err
    assert not other.exists()  # refused before anything is written


async def test_host_add_takes_the_credential_options(server: Running, tmp_path: Path) -> None:
    cli = Sandboxctl(server.url, server.admin_token, tmp_path / "cli")
    code, out, err = await cli.run_async(
        "host", "add", "tls1", "qemu+tls://127.0.0.1:1/system", "-o", "json"
    )
    assert code == 0, err
    assert '"state": "unreachable"' in out, out
    assert (tmp_path / "data" / "host-credentials" / "tls1" / "tls" / "clientkey.pem").exists()
    known = tmp_path / "known_hosts"
    known.write_text("not an entry\n")
    code, out, err = await cli.run_async(
        "host",
        "add",
        "ssh1",
        "qemu+ssh://ops@127.0.0.1:1/system",
        "--ssh-key-secret",
        "missing",
        "--ssh-known-hosts",
        str(known),
    )
    assert code != 0 and "ssh_known_hosts" in err, (out, err)
    code, out, err = await cli.run_async(
        "host", "add", "bad", "qemu+ssh://ops@127.0.0.1:1/system?command=/bin/sh"
    )
    assert code != 0 and "command" in err, (out, err)
