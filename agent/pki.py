"""Key pair and certificate request for enrollment, with the standard library only.

The agent must install into a guest without the server's dependencies (no `cryptography`), so
this module makes an ECDSA P-256 key, its PKCS#8 PEM and a PKCS#10 CSR (ecdsa-with-SHA256)
itself: short DER encoding and textbook curve arithmetic. It signs exactly one message per key
(the CSR); every TLS handshake afterwards is done by gRPC's BoringSSL with the PEM key.
Python integers are not constant-time; signing once per enrollment or renewal, inside the
guest, keeps that exposure negligible.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

# ---- P-256 (secp256r1) ----------------------------------------------------------------------
P = 0xFFFFFFFF00000001000000000000000000000000FFFFFFFFFFFFFFFFFFFFFFFF
A = P - 3
B = 0x5AC635D8AA3A93E7B3EBBD55769886BC651D06B0CC53B0F63BCE3C3E27D2604B
N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
G = (
    0x6B17D1F2E12C4247F8BCE6E563A440F277037D812DEB33A0F4A13945D898C296,
    0x4FE342E2FE1A7F9B8EE7EB4A7C0F9E162BCE33576B315ECECBB6406837BF51F5,
)

Jacobian = tuple[int, int, int]


def _double(pt: Jacobian) -> Jacobian:
    x, y, z = pt
    if y == 0 or z == 0:
        return (0, 1, 0)
    ysq = y * y % P
    s = 4 * x * ysq % P
    zz = z * z % P
    m = 3 * (x - zz) * (x + zz) % P  # a = -3
    nx = (m * m - 2 * s) % P
    ny = (m * (s - nx) - 8 * ysq * ysq) % P
    nz = 2 * y * z % P
    return (nx, ny, nz)


def _add(p1: Jacobian, p2: Jacobian) -> Jacobian:
    if p1[2] == 0:
        return p2
    if p2[2] == 0:
        return p1
    x1, y1, z1 = p1
    x2, y2, z2 = p2
    z1z1 = z1 * z1 % P
    z2z2 = z2 * z2 % P
    u1 = x1 * z2z2 % P
    u2 = x2 * z1z1 % P
    s1 = y1 * z2 * z2z2 % P
    s2 = y2 * z1 * z1z1 % P
    if u1 == u2:
        return _double(p1) if s1 == s2 else (0, 1, 0)
    h = (u2 - u1) % P
    r = (s2 - s1) % P
    hh = h * h % P
    hhh = h * hh % P
    v = u1 * hh % P
    nx = (r * r - hhh - 2 * v) % P
    ny = (r * (v - nx) - s1 * hhh) % P
    nz = h * z1 * z2 % P
    return (nx, ny, nz)


def _mul(k: int, point: tuple[int, int]) -> tuple[int, int]:
    result: Jacobian = (0, 1, 0)
    addend: Jacobian = (point[0], point[1], 1)
    while k:
        if k & 1:
            result = _add(result, addend)
        addend = _double(addend)
        k >>= 1
    x, y, z = result
    if z == 0:
        raise ValueError("point at infinity")
    zinv = pow(z, -1, P)
    zinv2 = zinv * zinv % P
    return (x * zinv2 % P, y * zinv2 * zinv % P)


def on_curve(x: int, y: int) -> bool:
    return (y * y - (x * x * x + A * x + B)) % P == 0


# ---- DER --------------------------------------------------------------------------------------
def _len(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _tlv(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + _len(len(body)) + body


def der_int(value: int) -> bytes:
    body = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big")
    return _tlv(0x02, body)


def der_seq(*items: bytes) -> bytes:
    return _tlv(0x30, b"".join(items))


def der_set(*items: bytes) -> bytes:
    return _tlv(0x31, b"".join(sorted(items)))


def der_oid(dotted: str) -> bytes:
    parts = [int(p) for p in dotted.split(".")]
    body = bytearray([40 * parts[0] + parts[1]])
    for part in parts[2:]:
        chunk = [part & 0x7F]
        part >>= 7
        while part:
            chunk.append(0x80 | (part & 0x7F))
            part >>= 7
        body.extend(reversed(chunk))
    return _tlv(0x06, bytes(body))


def der_bitstring(data: bytes) -> bytes:
    return _tlv(0x03, b"\x00" + data)


def der_octets(data: bytes) -> bytes:
    return _tlv(0x04, data)


def der_utf8(text: str) -> bytes:
    return _tlv(0x0C, text.encode())


OID_EC_PUBLIC_KEY = "1.2.840.10045.2.1"
OID_P256 = "1.2.840.10045.3.1.7"
OID_ECDSA_SHA256 = "1.2.840.10045.4.3.2"
OID_COMMON_NAME = "2.5.4.3"


def pem(label: str, der: bytes) -> bytes:
    b64 = base64.encodebytes(der).replace(b"\n", b"")
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    return (
        f"-----BEGIN {label}-----\n".encode()
        + b"\n".join(lines)
        + f"\n-----END {label}-----\n".encode()
    )


# ---- keys and requests ------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyPair:
    private: int
    public: tuple[int, int]

    @classmethod
    def generate(cls) -> KeyPair:
        d = secrets.randbelow(N - 1) + 1
        return cls(d, _mul(d, G))

    @property
    def public_point(self) -> bytes:
        x, y = self.public
        return b"\x04" + x.to_bytes(32, "big") + y.to_bytes(32, "big")

    def spki_der(self) -> bytes:
        return der_seq(
            der_seq(der_oid(OID_EC_PUBLIC_KEY), der_oid(OID_P256)), der_bitstring(self.public_point)
        )

    def private_pem(self) -> bytes:
        """PKCS#8 `PRIVATE KEY` PEM (what gRPC loads)."""
        ec_key = der_seq(
            der_int(1),
            der_octets(self.private.to_bytes(32, "big")),
            _tlv(0xA1, der_bitstring(self.public_point)),
        )
        info = der_seq(
            der_int(0),
            der_seq(der_oid(OID_EC_PUBLIC_KEY), der_oid(OID_P256)),
            der_octets(ec_key),
        )
        return pem("PRIVATE KEY", info)

    def sign(self, message: bytes) -> bytes:
        """ECDSA P-256 with SHA-256; a DER `Ecdsa-Sig-Value`."""
        e = int.from_bytes(hashlib.sha256(message).digest(), "big")
        while True:
            k = secrets.randbelow(N - 1) + 1
            r = _mul(k, G)[0] % N
            if r == 0:
                continue
            s = pow(k, -1, N) * (e + r * self.private) % N
            if s == 0:
                continue
            return der_seq(der_int(r), der_int(s))


def csr_pem(key: KeyPair, common_name: str) -> bytes:
    """A PKCS#10 request for `key` (the server ignores the subject and names the instance)."""
    subject = der_seq(der_set(der_seq(der_oid(OID_COMMON_NAME), der_utf8(common_name))))
    info = der_seq(der_int(0), subject, key.spki_der(), b"\xa0\x00")
    signature = key.sign(info)
    request = der_seq(info, der_seq(der_oid(OID_ECDSA_SHA256)), der_bitstring(signature))
    return pem("CERTIFICATE REQUEST", request)


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
