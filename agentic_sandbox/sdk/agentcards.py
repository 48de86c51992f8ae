"""The signed A2A AgentCard of an instance: fetch it and its JWKS, verify the signature.

A card is signed as A2A 1.0 says: the card without `signatures`, canonicalized by JCS
(RFC 8785), signed as a JWS with Ed25519 (`alg: EdDSA`), the detached `protected` and
`signature` parts kept in `signatures[]`; the instance's public keys are at
`/agents/{id}/.well-known/jwks.json`. Cards and JWKS are public: fetched without a token.
"""

from __future__ import annotations

import base64
import binascii
import json
import warnings
from typing import Any

from agentic_sandbox.sdk.errors import SandboxError, SignatureInvalid
from agentic_sandbox.sdk.models import VerifiedCard
from agentic_sandbox.sdk.operations import Resource

ALGORITHM = "EdDSA"


def _b64url_json(part: str) -> dict[str, Any]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (ValueError, binascii.Error):
        raise SignatureInvalid("a signature's protected header is not base64url JSON") from None
    if not isinstance(doc, dict):
        raise SignatureInvalid("a signature's protected header is not a JSON object")
    return doc


def verify_card(card: dict[str, Any], jwks: dict[str, Any], jwks_url: str = "") -> VerifiedCard:
    """The first of the card's signatures that verifies with a key of `jwks`, or
    `SignatureInvalid` saying why none does."""
    try:
        import rfc8785
        from joserfc import jws
        from joserfc.errors import JoseError
        from joserfc.jwk import OKPKey
    except ImportError as exc:  # the `cli` / `sdk` extras install them
        raise SandboxError(f"verifying a card needs joserfc and rfc8785: {exc}") from None
    signatures = card.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise SignatureInvalid("the card has no signatures")
    keys = {k.get("kid"): k for k in jwks.get("keys", []) if isinstance(k, dict)}
    payload = {k: v for k, v in card.items() if k != "signatures"}
    body = base64.urlsafe_b64encode(rfc8785.dumps(payload)).decode().rstrip("=")
    reasons = []
    for sig in signatures:
        if not isinstance(sig, dict) or "protected" not in sig or "signature" not in sig:
            reasons.append("a signature without `protected` and `signature`")
            continue
        header = _b64url_json(str(sig["protected"]))
        kid = str(header.get("kid", ""))
        jwk = keys.get(kid)
        if jwk is None:
            reasons.append(f"key {kid!r} is not in the instance's JWKS")
            continue
        if header.get("alg") != ALGORITHM:
            reasons.append(f"key {kid!r}: algorithm {header.get('alg')!r}, not {ALGORITHM}")
            continue
        compact = f"{sig['protected']}.{body}.{sig['signature']}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # joserfc prefers RFC 9864's "Ed25519"
            try:
                jws.deserialize_compact(compact, OKPKey.import_key(jwk), algorithms=[ALGORITHM])
            except (JoseError, ValueError) as exc:
                reasons.append(f"key {kid!r}: {exc.__class__.__name__}")
                continue
        return VerifiedCard(card, kid, dict(jwk), jwks_url, header)
    raise SignatureInvalid("the card's signature does not verify: " + "; ".join(reasons))


class AsyncAgentCards(Resource):
    def card_url(self, instance_id: str) -> str:
        return f"{self._t.url}/agents/{instance_id}/.well-known/agent-card.json"

    def jwks_url(self, instance_id: str) -> str:
        return f"{self._t.url}/agents/{instance_id}/.well-known/jwks.json"

    async def get(self, instance_id: str) -> dict[str, Any]:
        """The instance's AgentCard (A2A 1.0 JSON) as published."""
        card: dict[str, Any] = await self._t.request(
            "GET", f"/agents/{instance_id}/.well-known/agent-card.json", auth=False
        )
        return card

    async def jwks(self, instance_id: str) -> dict[str, Any]:
        jwks: dict[str, Any] = await self._t.request(
            "GET", f"/agents/{instance_id}/.well-known/jwks.json", auth=False
        )
        return jwks

    async def verify(self, instance_id: str, card: dict[str, Any] | None = None) -> VerifiedCard:
        """Fetch the card (or take `card`) and the instance's JWKS; check the signature."""
        if card is None:
            card = await self.get(instance_id)
        return verify_card(card, await self.jwks(instance_id), self.jwks_url(instance_id))
