"""Credentials and secrets: operator tokens, A2A API keys, write-only secrets."""

from __future__ import annotations

from collections.abc import Sequence

from agentic_sandbox.sdk.models import ApiKey, CreatedApiKey, CreatedToken, Secret, Token, WhoAmI
from agentic_sandbox.sdk.operations import ADMIN, Resource

TokenRole = str  # "admin" | "operator" | "viewer"


class AsyncTokens(Resource):
    async def create(
        self,
        subject: str,
        *,
        role: TokenRole = "operator",
        description: str = "",
        expires_in_seconds: int | None = None,
    ) -> CreatedToken:
        """A new operator token; its value (`.token`) is shown this once."""
        body: dict[str, object] = {"subject": subject, "role": role, "description": description}
        if expires_in_seconds is not None:
            body["expires_in_seconds"] = expires_in_seconds
        return await self._t.model(CreatedToken, "POST", f"{ADMIN}/tokens", json_body=body)

    async def list(self) -> list[Token]:
        """Admins see every token; others the one they call with."""
        return await self._t.items(Token, f"{ADMIN}/tokens")

    async def revoke(self, token_id: str) -> None:
        """Its WebSocket and SSE streams end at once."""
        await self._t.request("DELETE", f"{ADMIN}/tokens/{token_id}")

    async def whoami(self) -> WhoAmI:
        return await self._t.model(WhoAmI, "GET", f"{ADMIN}/whoami")


class AsyncApiKeys(Resource):
    async def create(
        self,
        instance_id: str,
        *,
        scopes: Sequence[str] | None = None,
        name: str | None = None,
        expires_in_seconds: int | None = None,
    ) -> CreatedApiKey:
        """An A2A key bound to one instance (`a2a:read`, `a2a:invoke`); `.key` shown once."""
        body: dict[str, object] = {"instance_id": instance_id}
        if scopes is not None:
            body["scopes"] = list(scopes)
        if name is not None:
            body["name"] = name
        if expires_in_seconds is not None:
            body["expires_in_seconds"] = expires_in_seconds
        return await self._t.model(CreatedApiKey, "POST", f"{ADMIN}/api-keys", json_body=body)

    async def list(self, *, instance_id: str | None = None) -> list[ApiKey]:
        return await self._t.items(ApiKey, f"{ADMIN}/api-keys", {"instance_id": instance_id})

    async def revoke(self, key_id: str) -> None:
        await self._t.request("DELETE", f"{ADMIN}/api-keys/{key_id}")


class AsyncSecrets(Resource):
    async def set(
        self,
        name: str,
        value: str,
        *,
        instances: Sequence[str] = (),
        env_name: str | None = None,
    ) -> Secret:
        """Create or replace; the value is never returned by any call."""
        body: dict[str, object] = {"value": value, "instances": list(instances)}
        if env_name is not None:
            body["env_name"] = env_name
        return await self._t.model(Secret, "PUT", f"{ADMIN}/secrets/{name}", json_body=body)

    async def list(self) -> list[Secret]:
        """Names and bindings, never values."""
        return await self._t.items(Secret, f"{ADMIN}/secrets")

    async def delete(self, name: str) -> None:
        await self._t.request("DELETE", f"{ADMIN}/secrets/{name}")
