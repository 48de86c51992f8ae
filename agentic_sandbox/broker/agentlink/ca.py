"""The server's own certificate authority for agent links (the `cryptography` package).

- The CA key and certificate live in `<data_dir>/agent-ca/` (key 0600), made on first start.
- The gRPC listener's certificate is issued by the CA at every start, naming
  `agentic-sandbox-server` (the name agents verify), `localhost` and the loopback addresses.
- Agent certificates name their instance in a URI SAN, `spiffe://agentic-sandbox/instance/<id>`
  (plus a DNS SAN `<id>.instance.agentic-sandbox`) and the instance's incarnation in a second URI
  SAN, `urn:agentic-sandbox:incarnation:<uuid>`, with the clientAuth extended key usage. The
  server reads both only from a certificate the TLS layer has verified.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "agentic-sandbox-server"
SPIFFE_PREFIX = "spiffe://agentic-sandbox/instance/"
INCARNATION_PREFIX = "urn:agentic-sandbox:incarnation:"
INSTANCE_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
CA_LIFETIME = dt.timedelta(days=3650)
SERVER_CERT_LIFETIME = dt.timedelta(days=365)
CLOCK_SKEW = dt.timedelta(minutes=5)
LIBVIRT_CLIENT_NAME = SERVER_NAME  # the CN a libvirtd's tls_allowed_dn_list can name
LIBVIRT_CERT_LIFETIME = dt.timedelta(days=365)
DNS_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


class CertificateError(Exception):
    """A CSR or certificate that cannot be used; the message says why."""


@dataclass(frozen=True)
class IssuedCertificate:
    pem: bytes
    serial: str
    instance_id: str
    incarnation: str
    not_before: dt.datetime
    not_after: dt.datetime


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def instance_uri(instance_id: str) -> str:
    return SPIFFE_PREFIX + instance_id


def instance_from_certificate(cert: x509.Certificate) -> str:
    """The instance a (verified) agent certificate names; CertificateError if none or several."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateError("certificate has no subject alternative name") from None
    ids = {
        uri[len(SPIFFE_PREFIX) :]
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(SPIFFE_PREFIX)
    }
    if len(ids) != 1:
        raise CertificateError("certificate must name exactly one instance")
    instance_id = ids.pop()
    if not INSTANCE_RE.match(instance_id):
        raise CertificateError("certificate names an invalid instance id")
    return instance_id


def incarnation_from_certificate(cert: x509.Certificate) -> str:
    """The incarnation a (verified) agent certificate names; CertificateError if none or
    several (a certificate from before incarnations names none: it is refused)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateError("certificate has no subject alternative name") from None
    found = {
        uri[len(INCARNATION_PREFIX) :]
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(INCARNATION_PREFIX)
    }
    if len(found) != 1:
        raise CertificateError("certificate must name exactly one instance incarnation")
    value = found.pop()
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise CertificateError("certificate names an invalid incarnation") from None


def serial_hex(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


class CertificateAuthority:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        try:
            directory.chmod(0o700)
        except PermissionError:
            pass
        key_path, cert_path = directory / "ca.key", directory / "ca.crt"
        if key_path.exists() and cert_path.exists():
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise CertificateError(f"{key_path}: the CA key must be an EC key")
            self._key = key
            self.certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
        else:
            self._key = ec.generate_private_key(ec.SECP256R1())
            self.certificate = self._make_ca()
            _write_private(
                key_path,
                self._key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                ),
            )
            cert_path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        self.certificate_pem = self.certificate.public_bytes(serialization.Encoding.PEM)

    def _make_ca(self) -> x509.Certificate:
        now = dt.datetime.now(dt.UTC)
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentic-sandbox"),
                x509.NameAttribute(NameOID.COMMON_NAME, "agentic-sandbox agent CA"),
            ]
        )
        return (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )

    def _leaf(
        self,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey,
        common_name: str,
        sans: list[x509.GeneralName],
        usage: x509.ObjectIdentifier,
        lifetime: dt.timedelta,
        *,
        key_encipherment: bool = False,
    ) -> x509.Certificate:
        now = dt.datetime.now(dt.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    content_commitment=False,
                    key_encipherment=key_encipherment or isinstance(public_key, rsa.RSAPublicKey),
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )

    def server_credentials(self, extra_names: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
        """A fresh (key PEM, certificate chain PEM) for the gRPC listener."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(SERVER_NAME), x509.DNSName("localhost")]
        for addr in ("127.0.0.1", "::1"):
            sans.append(x509.IPAddress(ipaddress.ip_address(addr)))
        for name in extra_names:
            try:
                ip = ipaddress.ip_address(name)
            except ValueError:
                general: x509.GeneralName = x509.DNSName(name)
            else:
                general = x509.IPAddress(ip)
            if general not in sans:
                sans.append(general)
        cert = self._leaf(
            key.public_key(),
            SERVER_NAME,
            sans,
            ExtendedKeyUsageOID.SERVER_AUTH,
            SERVER_CERT_LIFETIME,
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return key_pem, cert.public_bytes(serialization.Encoding.PEM) + self.certificate_pem

    def issue_agent(
        self, csr_pem: bytes, instance_id: str, incarnation: str, lifetime: dt.timedelta
    ) -> IssuedCertificate:
        """Sign an agent's CSR for one incarnation of `instance_id` (the CSR's subject is
        ignored)."""
        if not INSTANCE_RE.match(instance_id):
            raise CertificateError("invalid instance id")
        incarnation = str(uuid.UUID(incarnation))
        public_key = _csr_public_key(csr_pem, ed25519_ok=True)
        sans: list[x509.GeneralName] = [
            x509.UniformResourceIdentifier(instance_uri(instance_id)),
            x509.UniformResourceIdentifier(INCARNATION_PREFIX + incarnation),
            x509.DNSName(f"{instance_id}.instance.agentic-sandbox"),
        ]
        cert = self._leaf(public_key, instance_id, sans, ExtendedKeyUsageOID.CLIENT_AUTH, lifetime)
        return IssuedCertificate(
            pem=cert.public_bytes(serialization.Encoding.PEM),
            serial=serial_hex(cert),
            instance_id=instance_id,
            incarnation=incarnation,
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
        )

    def libvirt_client_credentials(self) -> tuple[bytes, bytes]:
        """A fresh (key PEM, certificate PEM) with which this server connects to ``qemu+tls``
        hosts (CN ``agentic-sandbox-server``, clientAuth; libvirt wants key encipherment in
        the critical key usage, so it is set)."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._leaf(
            key.public_key(),
            LIBVIRT_CLIENT_NAME,
            [x509.DNSName(SERVER_NAME)],
            ExtendedKeyUsageOID.CLIENT_AUTH,
            LIBVIRT_CERT_LIFETIME,
            key_encipherment=True,
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return key_pem, cert.public_bytes(serialization.Encoding.PEM)

    def issue_libvirtd(self, csr_pem: bytes, names: list[str]) -> bytes:
        """Sign a libvirtd's CSR as its TLS server certificate for `names` (addresses or DNS
        names the fleet's URI uses; the CSR's subject is ignored). The key never leaves the
        host that made it."""
        if not names:
            raise CertificateError("name at least one address or DNS name of the host")
        public_key = _csr_public_key(csr_pem, ed25519_ok=False)
        sans: list[x509.GeneralName] = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                if not DNS_RE.match(name):
                    raise CertificateError(f"not an address or DNS name: {name!r}") from None
                sans.append(x509.DNSName(name))
        cert = self._leaf(
            public_key,
            names[0],
            sans,
            ExtendedKeyUsageOID.SERVER_AUTH,
            LIBVIRT_CERT_LIFETIME,
            key_encipherment=True,
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def verify_issued(self, cert: x509.Certificate) -> None:
        """Raise CertificateError unless `cert` was signed by this CA (belt and braces: the TLS
        layer has already verified the chain)."""
        try:
            cert.verify_directly_issued_by(self.certificate)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise CertificateError(f"certificate not issued by this CA: {exc}") from None


def _csr_public_key(
    csr_pem: bytes, *, ed25519_ok: bool
) -> ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey:
    """The public key of a certificate request whose signature verifies, of a kind and size
    this CA signs (EC P-256/P-384, RSA ≥ 2048, and Ed25519 where `ed25519_ok`: libvirt's
    GnuTLS TLS server keys are EC or RSA)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate request: {exc}") from None
    try:
        valid = csr.is_signature_valid
    except (InvalidSignature, ValueError):
        valid = False
    if not valid:
        raise CertificateError("the request's signature does not verify")
    public_key = csr.public_key()
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if public_key.curve.name not in ("secp256r1", "secp384r1"):
            raise CertificateError("EC keys must be P-256 or P-384")
    elif isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < 2048:
            raise CertificateError("RSA keys must have at least 2048 bits")
    elif not (ed25519_ok and isinstance(public_key, ed25519.Ed25519PublicKey)):
        kinds = "EC P-256/P-384, RSA or Ed25519" if ed25519_ok else "EC P-256/P-384 or RSA"
        raise CertificateError(f"unsupported key type (use {kinds})")
    return public_key
