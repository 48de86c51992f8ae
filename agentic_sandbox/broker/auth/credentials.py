"""Bearer credentials: random, shown once, stored only as a SHA-256 hash.

Tokens carry 256 bits of randomness, so a plain SHA-256 is the right hash (a slow password hash
buys nothing against a search space that large, and lookups stay O(1) by hash).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

OPERATOR_PREFIX = "sbx_"
APIKEY_PREFIX = "sbk_"
ENROLL_PREFIX = "sbe_"


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def new_id() -> str:
    return secrets.token_hex(8)


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def display_prefix(value: str) -> str:
    """What listings show so a person can tell tokens apart (never enough to use one)."""
    return value[:10]


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
