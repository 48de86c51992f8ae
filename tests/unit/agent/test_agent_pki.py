"""Enrollment crypto: the agent's key and CSR (made by openssl), the server CA and its checks."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agentic_sandbox.agent import pki
from agentic_sandbox.broker.agentlink.ca import (
    SERVER_NAME,
    CertificateAuthority,
    CertificateError,
    incarnation_from_certificate,
    instance_from_certificate,
)

INC = "5b0c7f5e-2b3c-4d5e-8f90-1a2b3c4d5e6f"


def test_agent_key_and_csr_are_standard(tmp_path: Path) -> None:
    key_pem, csr_pem = pki.new_key_and_csr("web-1")
    csr = x509.load_pem_x509_csr(csr_pem)
    assert csr.is_signature_valid
    assert csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "web-1"
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, what gRPC loads
    loaded = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(loaded, ec.EllipticCurvePrivateKey) and loaded.curve.name == "secp256r1"
    pub = csr.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    assert pub.public_numbers() == loaded.public_key().public_numbers()
    assert pki.new_key_and_csr("web-1")[0] != key_pem  # a new key each time
    path = tmp_path / "k" / "agent.key"
    pki.write_private(path, key_pem)
    assert path.stat().st_mode & 0o777 == 0o600


def test_agent_key_errors_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pki.PkiError, match="common name"):
        pki.new_key_and_csr("a/CN=evil")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pki.PkiError, match="install openssl"):
        pki.new_key_and_csr("web-1")


def test_ca_issues_instance_certificates_from_any_csr_subject(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    _key, csr_pem = pki.new_key_and_csr("i-am-someone-else")
    incarnation = str(uuid.uuid4())
    issued = ca.issue_agent(csr_pem, "web-1", incarnation, dt.timedelta(hours=1))
    cert = x509.load_pem_x509_certificate(issued.pem)
    assert instance_from_certificate(cert) == "web-1"
    assert incarnation_from_certificate(cert) == incarnation == issued.incarnation
    cert.verify_directly_issued_by(ca.certificate)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ca.verify_issued(cert)
    # The same directory later: the same CA.
    again = CertificateAuthority(tmp_path / "ca")
    assert again.certificate_pem == ca.certificate_pem
    _key_pem, chain = ca.server_credentials(("10.0.2.2", "ctl.example"))
    server_cert = x509.load_pem_x509_certificate(chain)
    names = server_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert SERVER_NAME in names.get_values_for_type(x509.DNSName)
    assert "ctl.example" in names.get_values_for_type(x509.DNSName)


def test_ca_refuses_bad_requests(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    with pytest.raises(CertificateError):
        ca.issue_agent(b"not a csr", "web-1", INC, dt.timedelta(hours=1))
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .sign(weak, hashes.SHA256())
    )
    with pytest.raises(CertificateError, match="2048"):
        ca.issue_agent(csr.public_bytes(serialization.Encoding.PEM), "web-1", INC, dt.timedelta(1))
    with pytest.raises(CertificateError, match="instance id"):
        ca.issue_agent(pki.new_key_and_csr("x")[1], "Bad_Id", INC, dt.timedelta(1))
    other = CertificateAuthority(tmp_path / "other")
    foreign = other.issue_agent(pki.new_key_and_csr("x")[1], "web-1", INC, dt.timedelta(hours=1))
    with pytest.raises(CertificateError):
        ca.verify_issued(x509.load_pem_x509_certificate(foreign.pem))
