"""Credentials of remote hosts through the hosts API: a qemu+tls host gets a client identity
from the server's CA (files 0700/0600 under the data dir, renewed at start, never in an answer
or the hosts table); a qemu+ssh host's key comes from the caller's vault secret; URIs that
would run a command or skip a check are refused naming the field, and nothing is half-added.
The hosts are reached at 127.0.0.1:1 (nothing listens): they stay unreachable, with a reason."""

from __future__ import annotations

import ipaddress
import json
import stat
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from sqlalchemy import select

from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.broker.store import models as m
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import node_uri

CLOSED = "127.0.0.1:1"  # nothing listens: refused at once


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


async def _rows(r: Running) -> str:
    async with r.server.svc.db.session() as s:
        rows = (await s.scalars(select(m.Host))).all()
        return json.dumps([[h.name, h.uri, h.labels, h.state_reason] for h in rows])


def _fleet(r: Running) -> Any:
    return next(c for c in r.server.components if isinstance(c, FleetComponent)).fleet


async def test_a_tls_host_gets_a_client_identity_from_the_servers_ca(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    pki = tmp_path / "data" / "host-credentials" / "tls1" / "tls"
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        status, host, _ = await r.call(
            "POST",
            "/api/v2/admin/hosts",
            json={"name": "tls1", "uri": f"qemu+tls://{CLOSED}/system"},
        )
        assert status == 201, host
        assert host["state"] == "unreachable" and "refused" in host["reason"], host
        assert _mode(pki.parent) == 0o700 and _mode(pki) == 0o700
        assert _mode(pki / "clientkey.pem") == 0o600
        ca_pem = (tmp_path / "data" / "agent-ca" / "ca.crt").read_bytes()
        assert (pki / "cacert.pem").read_bytes() == ca_pem
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate((pki / "clientcert.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH in eku
        spec = _fleet(r).hosts["tls1"].spec
        assert spec.connection_uri == f"qemu+tls://{CLOSED}/system?pkipath={pki}"
        key = (pki / "clientkey.pem").read_bytes()
        _, listing, _ = await r.call("GET", "/api/v2/admin/hosts")
        rows = await _rows(r)
        for text in (json.dumps(host), json.dumps(listing), rows):
            assert "PRIVATE KEY" not in text and key.decode().splitlines()[1] not in text
        assert spec.uri in rows and "server-ca" in rows
    # a restart: the same identity (not yet due), the host opened with it again
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        assert _fleet(r).hosts["tls1"].spec.tls_pki_dir == str(pki)
        assert (pki / "clientkey.pem").read_bytes() == key
        status, _, _ = await r.call("DELETE", "/api/v2/admin/hosts/tls1")
        assert status == 204
        assert not pki.parent.exists()


async def test_an_operators_pki_directory_is_checked_and_kept(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    own = tmp_path / "operator-pki"
    own.mkdir()
    (own / "cacert.pem").write_text("x")
    body = {"name": "tls2", "uri": f"qemu+tls://{CLOSED}/system", "tls_pki_dir": str(own)}
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        status, problem, _ = await r.call("POST", "/api/v2/admin/hosts", json=body)
        assert status == 422 and "clientcert.pem, clientkey.pem" in problem["detail"], problem
        (own / "clientcert.pem").write_text("x")
        (own / "clientkey.pem").write_text("x")
        status, host, _ = await r.call("POST", "/api/v2/admin/hosts", json=body)
        assert status == 201, host
        assert _fleet(r).hosts["tls2"].spec.tls_pki_dir == str(own)
        assert not (tmp_path / "data" / "host-credentials" / "tls2").exists()
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        assert _fleet(r).hosts["tls2"].spec.tls_pki_dir == str(own)


async def test_refusals_name_the_field_and_add_nothing(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    cases = [
        ({"uri": f"qemu+tls://{CLOSED}/system?no_verify=1"}, "body.uri", "no_verify"),
        ({"uri": "qemu+ssh://root@h/system?command=/bin/sh"}, "body.uri", "command"),
        ({"uri": "qemu+ssh://root@h/system?netcat=nc"}, "body.uri", "netcat"),
        ({"uri": "qemu+ext:///system?command=/bin/true"}, "body.uri", "ext"),
        ({"uri": f"qemu+tls://{CLOSED}/system?pkipath=/etc"}, "body.uri", "set by the server"),
        (
            {"uri": f"qemu+tcp://{CLOSED}/system", "tls_pki_dir": "/etc"},
            "body.tls_pki_dir",
            "qemu+tls",
        ),
        ({"uri": f"qemu+ssh://ops@{CLOSED}/system"}, "body.ssh_key_secret", "vault secret"),
        (
            {"uri": f"qemu+ssh://ops@{CLOSED}/system", "ssh_key_secret": "nope"},
            "body.ssh_key_secret",
            "no secret named 'nope'",
        ),
        (
            {"uri": f"qemu+ssh://ops@{CLOSED}/system", "ssh_key_secret": "notakey"},
            "body.ssh_key_secret",
            "not an unencrypted private key",
        ),
    ]
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        status, _, _ = await r.call(
            "PUT", "/api/v2/admin/secrets/notakey", json={"value": "hunter2-not-a-key"}
        )
        assert status in (200, 201)
        for extra, field, says in cases:
            status, problem, _ = await r.call(
                "POST", "/api/v2/admin/hosts", json={"name": "bad", **extra}
            )
            assert status == 422, (extra, problem)
            fields = [e["field"] for e in problem.get("errors", [])]
            assert field in fields, (extra, problem)
            assert says in json.dumps(problem), (extra, problem)
            assert "hunter2" not in json.dumps(problem)
        _, listing, _ = await r.call("GET", "/api/v2/admin/hosts")
        assert [h["name"] for h in listing["items"]] == ["local"]
        assert not (tmp_path / "data" / "host-credentials" / "bad").exists()


async def test_an_ssh_host_uses_the_callers_vault_key_and_its_known_hosts(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    key = ed25519.Ed25519PrivateKey.generate()
    key_text = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    known = f"[127.0.0.1]:1 {public}\n"
    d = tmp_path / "data" / "host-credentials" / "ssh1" / "ssh"
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        status, _, _ = await r.call(
            "PUT", "/api/v2/admin/secrets/ssh1-key", json={"value": key_text}
        )
        assert status in (200, 201)
        status, problem, _ = await r.call(
            "POST",
            "/api/v2/admin/hosts",
            json={
                "name": "ssh1",
                "uri": f"qemu+ssh://ops@{CLOSED}/system",
                "ssh_key_secret": "ssh1-key",
                "ssh_known_hosts": "not a known hosts line\n",
            },
        )
        assert status == 422 and "line 1" in problem["detail"], problem
        assert not d.exists()
        status, host, _ = await r.call(
            "POST",
            "/api/v2/admin/hosts",
            json={
                "name": "ssh1",
                "uri": f"qemu+ssh://ops@{CLOSED}/system",
                "ssh_key_secret": "ssh1-key",
                "ssh_known_hosts": known,
            },
        )
        assert status == 201 and host["state"] == "unreachable", host
        assert (d / "id").read_text().strip() == key_text.strip()
        assert _mode(d / "id") == 0o600 and _mode(d) == 0o700
        assert (d / "known_hosts").read_text() == known
        uri = _fleet(r).hosts["ssh1"].spec.connection_uri
        assert uri.startswith(f"qemu+libssh2://ops@{CLOSED}/system?sshauth=privkey&keyfile=")
        assert "known_hosts_verify=normal" in uri and "no_verify" not in uri
        secret_line = key_text.splitlines()[1]
        _, listing, _ = await r.call("GET", "/api/v2/admin/hosts")
        for text in (json.dumps(host), json.dumps(listing), await _rows(r)):
            assert secret_line not in text and "PRIVATE KEY" not in text
        status, _, _ = await r.call("DELETE", "/api/v2/admin/hosts/ssh1")
        assert status == 204
        assert not d.exists()


async def test_a_libvirtd_gets_its_server_certificate_from_a_csr(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        status, out, _ = await r.call(
            "POST",
            "/api/v2/admin/hosts/libvirtd-certificate",
            json={"csr_pem": csr, "names": ["198.18.0.2", "h1.example"]},
        )
        assert status == 200, out
        assert set(out) == {"cacert_pem", "servercert_pem"}
        ca = x509.load_pem_x509_certificate(out["cacert_pem"].encode())
        cert = x509.load_pem_x509_certificate(out["servercert_pem"].encode())
        cert.verify_directly_issued_by(ca)
        assert cert.public_key() == key.public_key()
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("198.18.0.2")]
        assert san.get_values_for_type(x509.DNSName) == ["h1.example"]
        status, problem, _ = await r.call(
            "POST",
            "/api/v2/admin/hosts/libvirtd-certificate",
            json={"csr_pem": "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 80, "names": ["h"]},
        )
        assert status == 422 and "csr_pem" in json.dumps(problem), problem
        viewer = await r.make_token("vera", "viewer")
        status, _, _ = await r.call(
            "POST",
            "/api/v2/admin/hosts/libvirtd-certificate",
            token=viewer,
            json={"csr_pem": csr, "names": ["h"]},
        )
        assert status == 403
