"""Per-instance Ed25519 keys and AgentCard signatures (JCS + JWS).

Each instance has its own key pair (made on first use), stored in `instance_keys`: the public
JWK as is, the private JWK sealed with the data directory's vault key. `kid` is the RFC 7638
thumbprint. A card is signed as the A2A 1.0 spec says: the card without `signatures`,
canonicalized by JCS (RFC 8785, the `rfc8785` library), signed as a JWS (`joserfc`) with the
protected header `{"alg": "EdDSA", "kid": …, "typ": "JOSE"}`; the detached `protected` and
`signature` parts go into `signatures[]`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import warnings
from dataclasses import dataclass
from typing import Any

import rfc8785
from joserfc import jws
from joserfc.jwk import OKPKey
from sqlalchemy import select, update

from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.secrets.vault import Vault
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

ALG = "EdDSA"


@dataclass(frozen=True)
class SigningKey:
    kid: str
    key: OKPKey
    public_jwk: dict[str, Any]


def canonical(obj: Any) -> bytes:
    return rfc8785.dumps(obj)


def sign_detached(payload: dict[str, Any], key: SigningKey) -> dict[str, str]:
    """The AgentCardSignature `{protected, signature}` of `payload` (JCS bytes)."""
    header = {"alg": ALG, "kid": key.kid, "typ": "JOSE"}
    with warnings.catch_warnings():
        # RFC 9864 prefers "Ed25519"; A2A 1.0 and its verifiers use "EdDSA".
        warnings.simplefilter("ignore")
        compact = jws.serialize_compact(header, canonical(payload), key.key, algorithms=[ALG])
    protected, _, signature = compact.split(".")
    return {"protected": protected, "signature": signature}


def verify_detached(
    payload: dict[str, Any], sig: dict[str, str], public_jwk: dict[str, Any]
) -> bool:
    """Check a signature made by `sign_detached` (used by tests and tools)."""

    body = base64.urlsafe_b64encode(canonical(payload)).decode().rstrip("=")
    compact = f"{sig['protected']}.{body}.{sig['signature']}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            jws.deserialize_compact(compact, OKPKey.import_key(public_jwk), algorithms=[ALG])
        except Exception:
            return False
    return True


class InstanceKeys:
    def __init__(self, db: Database, vault: Vault) -> None:
        self._db = db
        self._vault = vault
        self._cache: dict[str, SigningKey] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def signing_key(self, instance_id: str) -> SigningKey:
        hit = self._cache.get(instance_id)
        if hit is not None:
            return hit
        lock = self._locks.setdefault(instance_id, asyncio.Lock())
        async with lock:
            hit = self._cache.get(instance_id)
            if hit is not None:
                return hit
            async with self._db.session() as s:
                incarnation = await s.scalar(
                    select(m.Instance.incarnation).where(m.Instance.id == instance_id)
                )
                row = await s.scalar(
                    select(m.InstanceKey)
                    .where(
                        m.InstanceKey.instance_id == instance_id,
                        m.InstanceKey.incarnation == incarnation,
                        m.InstanceKey.retired_at.is_(None),
                    )
                    .order_by(m.InstanceKey.created_at.desc())
                    .limit(1)
                )
            if row is None:
                key = OKPKey.generate_key("Ed25519")
                kid = key.thumbprint()
                public = {**key.as_dict(private=False), "kid": kid, "use": "sig", "alg": ALG}
                sealed = self._vault.seal(json.dumps(key.as_dict(private=True)).encode())
                async with self._db.session() as s:
                    s.add(
                        m.InstanceKey(
                            kid=kid,
                            instance_id=instance_id,
                            incarnation=incarnation or "",
                            private_ciphertext=sealed,
                            public_jwk=public,
                        )
                    )
                found = SigningKey(kid, key, public)
            else:
                private = json.loads(self._vault.open(row.private_ciphertext))
                found = SigningKey(row.kid, OKPKey.import_key(private), dict(row.public_jwk))
            self._cache[instance_id] = found
            return found

    async def jwks(self, instance_id: str) -> dict[str, Any]:
        """The instance's public keys (a JWK Set); creates the key on first use."""
        await self.signing_key(instance_id)
        async with self._db.session() as s:
            rows = (
                await s.scalars(
                    select(m.InstanceKey)
                    .where(
                        m.InstanceKey.instance_id == instance_id, m.InstanceKey.retired_at.is_(None)
                    )
                    .order_by(m.InstanceKey.created_at)
                )
            ).all()
        return {"keys": [dict(r.public_jwk) for r in rows]}

    async def end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's card keys are retired: a new instance with the id signs its
        card with a key of its own, and the old key no longer appears in its JWKS."""
        self._cache.pop(ended.instance_id, None)
        async with self._db.session() as s:
            await s.execute(
                update(m.InstanceKey)
                .where(
                    m.InstanceKey.instance_id == ended.instance_id,
                    m.InstanceKey.retired_at.is_(None),
                )
                .values(retired_at=dt.datetime.now(dt.UTC))
            )
