"""TLS interception for brokered credentials: a CA per incarnation, its leaf certificates, and
the TLS contexts of both sides (`cryptography` makes the keys and certificates, the standard
library's `ssl` speaks TLS; nothing here is hand-written crypto).

- **The CA** (`IncarnationCA`) is made for one incarnation of one instance, in the server's
  memory only: its key is never written anywhere (the leaf's key and certificate reach
  OpenSSL through an anonymous memory file, `memfd_create`, closed at once). Its subject names
  the instance and its incarnation (`OU=incarnation <uuid>`, and a URI SAN
  `urn:agentic-sandbox:incarnation:<uuid>` as the agent certificates have); it is a CA for leaf
  certificates only (`pathlen:0`, `keyCertSign`), and only for the instance's brokered
  destinations: a critical **name constraint** permits exactly their host names (as DNS
  names: the name and the names under it, RFC 5280) and address literals (as single-address
  IP subtrees), so its key, were it stolen, mints nothing a client trusts for any other name;
  with no destination of a kind it permits the reserved `invalid` name / the single address
  `0.0.0.0` (a permitted subtree of each kind is what makes the kind constrained at all). A
  credential change that changes the set of destinations makes a new CA (the service does,
  and the component sends it to the guest at once). It ends with the incarnation (`destroy`:
  the key and every context are dropped, a later use raises `CAEnded`) and is valid for
  `CA_LIFETIME` at most (a fresh one is made, and sent to the guest at its next registration,
  when less than `CA_RENEW_BEFORE` is left). A server restart makes a new one too: the agent
  gets it at its reconnect (the `egress_trust` stream).
- **Leaves**: one per destination name (or address literal), `serverAuth`, valid for
  `LEAF_LIFETIME` and never past the CA; cached per name, bounded.
- **Upstream**: `upstream_context` verifies the real server against the host's trust store
  (`ssl.create_default_context`), plus, when the server's settings name one
  (`SANDBOX_EGRESS_UPSTREAM_CA_FILE`), the CAs of that file — added, never instead, and
  verification is never switched off.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
import ssl
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_LIFETIME = dt.timedelta(days=30)
CA_RENEW_BEFORE = dt.timedelta(days=1)
LEAF_LIFETIME = dt.timedelta(days=1)
LEAF_RENEW_BEFORE = dt.timedelta(hours=1)
BACKDATE = dt.timedelta(minutes=5)  # a guest clock a little behind still accepts them
MAX_LEAVES = 256
ALPN = ["http/1.1"]  # what the proxy speaks inside an intercepted tunnel


class CAEnded(Exception):
    """The CA's incarnation ended: it signs nothing more."""


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _leaf_subject(host: str) -> x509.Name:
    """CN = the name; an address literal's leaf has no CN (OpenSSL checks a CN that looks like a
    DNS name, as "10.9.0.2" does, against the DNS name constraints when there is no DNS SAN)."""
    if isinstance(_san(host), x509.IPAddress):
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentic-sandbox egress")])
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])])


NOTHING_DNS = "invalid"  # RFC 6761: never a real name
NOTHING_IP = ipaddress.ip_network("0.0.0.0/32")


def name_constraints(names: Iterable[str]) -> x509.NameConstraints:
    """Permitted subtrees of exactly `names` (host names and address literals)."""
    dns: list[x509.GeneralName] = []
    ips: list[x509.GeneralName] = []
    for name in sorted(set(names)):
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            dns.append(x509.DNSName(name))
            continue
        ips.append(x509.IPAddress(ipaddress.ip_network(address)))  # /32 or /128
    return x509.NameConstraints(
        permitted_subtrees=(dns or [x509.DNSName(NOTHING_DNS)])
        + (ips or [x509.IPAddress(NOTHING_IP)]),
        excluded_subtrees=None,
    )


class IncarnationCA:
    """The egress proxy's CA of one incarnation (see the module's doc)."""

    def __init__(
        self,
        instance_id: str,
        incarnation: str,
        *,
        names: Iterable[str],
        now: dt.datetime | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.names = frozenset(names)  # the only names its leaves are valid for
        start = now or dt.datetime.now(dt.UTC)
        self._key: ec.EllipticCurvePrivateKey | None = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key: ec.EllipticCurvePrivateKey | None = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentic-sandbox"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"incarnation {incarnation}"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"egress CA of {instance_id}"[:64]),
            ]
        )
        public = self._key.public_key()
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start - BACKDATE)
            .not_valid_after(start + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.UniformResourceIdentifier(
                            f"urn:agentic-sandbox:incarnation:{incarnation}"
                        )
                    ]
                ),
                critical=False,
            )
            .add_extension(name_constraints(self.names), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.certificate_pem = self.certificate.public_bytes(serialization.Encoding.PEM)
        self.fingerprint = hashlib.sha256(
            self.certificate.public_bytes(serialization.Encoding.DER)
        ).hexdigest()
        self._contexts: OrderedDict[str, tuple[dt.datetime, ssl.SSLContext]] = OrderedDict()

    @property
    def not_after(self) -> dt.datetime:
        return self.certificate.not_valid_after_utc

    @property
    def ended(self) -> bool:
        return self._key is None

    def fresh(self, now: dt.datetime | None = None) -> bool:
        """Still usable, and for long enough that a new one is not due."""
        now = now or dt.datetime.now(dt.UTC)
        return not self.ended and self.not_after - now > CA_RENEW_BEFORE

    def destroy(self) -> None:
        """The incarnation ended: the keys and every context are gone."""
        self._key = None
        self._leaf_key = None
        self._contexts.clear()

    def issue(self, host: str, *, now: dt.datetime | None = None) -> x509.Certificate:
        """A leaf certificate for `host` (a normalised name or an address literal)."""
        if self._key is None or self._leaf_key is None:
            raise CAEnded(f"the egress CA of {self.instance_id} ended with its incarnation")
        start = now or dt.datetime.now(dt.UTC)
        end = min(start + LEAF_LIFETIME, self.not_after)
        public = self._leaf_key.public_key()
        return (
            x509.CertificateBuilder()
            .subject_name(_leaf_subject(host))
            .issuer_name(self.name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start - BACKDATE)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_san(host)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )

    def server_context(self, host: str) -> ssl.SSLContext:
        """The TLS server context the proxy shows the guest for `host` (cached)."""
        now = dt.datetime.now(dt.UTC)
        cached = self._contexts.get(host)
        if cached is not None and cached[0] - now > LEAF_RENEW_BEFORE:
            self._contexts.move_to_end(host)
            return cached[1]
        leaf = self.issue(host, now=now)
        assert self._leaf_key is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(ALPN)
        _load_chain(ctx, leaf.public_bytes(serialization.Encoding.PEM) + _pem_key(self._leaf_key))
        self._contexts[host] = (leaf.not_valid_after_utc, ctx)
        while len(self._contexts) > MAX_LEAVES:
            self._contexts.popitem(last=False)
        return ctx


def _load_chain(ctx: ssl.SSLContext, pem: bytes) -> None:
    """`load_cert_chain` wants a path: an anonymous memory file, never the disk."""
    fd = os.memfd_create("egress-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def upstream_context(extra_ca_file: Path | None = None) -> ssl.SSLContext:
    """Verifies the real upstream server: the host's trust store (+ `extra_ca_file`'s CAs)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if extra_ca_file is not None:
        ctx.load_verify_locations(cafile=str(extra_ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(ALPN)
    return ctx
