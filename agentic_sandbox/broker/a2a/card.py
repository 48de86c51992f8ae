"""The AgentCard of an instance: A2A 1.0 fields only, no empty values, signed.

Skills come from the instance's profile (`broker.tasks.skills`). A skill's JSON Schema has no
AgentSkill field in A2A 1.0, so the schemas are published in a card extension
(`SKILL_SCHEMAS_EXT`) as JSON text per skill id (text keeps them exact: A2A canonicalization
drops empty strings, lists and objects, and Struct numbers become doubles). The extended card
(GetExtendedAgentCard, authenticated) adds an instance extension with live details.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from agentic_sandbox.broker.a2a.signing import InstanceKeys, sign_detached
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks import AgentProfile

PROTOCOL_VERSION = "1.0"
SKILL_SCHEMAS_EXT = "https://agentic-sandbox.dev/a2a/extensions/skill-input-schemas/v1"
INSTANCE_EXT = "https://agentic-sandbox.dev/a2a/extensions/instance/v1"
SKILL_SELECTOR = "skillId"


def clean_empty(value: Any) -> Any:
    """Drop empty strings, lists and objects (and None) recursively: the form A2A verifiers
    canonicalize, so the card we sign is the card they check."""
    if isinstance(value, dict):
        out = {k: c for k, v in value.items() if (c := clean_empty(v)) is not None}
        return out or None
    if isinstance(value, list):
        items = [c for v in value if (c := clean_empty(v)) is not None]
        return items or None
    if value == "" or value is None:
        return None
    return value


def agent_url(public_url: str, instance_id: str) -> str:
    return f"{public_url}/agents/{instance_id}"


def files_note(root: str) -> str:
    """Where a task's files go, for every skill's description (docs/a2a.md, "Files")."""
    return (
        f" Files: raw file parts of the message are written to the task's working directory "
        f"{root}/<task id> (also $A2A_WORKDIR; the run's working directory unless the task "
        f"runner sets one) before the run; regular files the run leaves in "
        f"{root}/<task id>/outbox ($A2A_OUTBOX) come back as artifacts with file parts (raw "
        "bytes when small, else a download URL under the admin files API)."
    )


def build_card(
    *,
    instance: m.Instance,
    profile: AgentProfile,
    public_url: str,
    server_version: str,
    extended: dict[str, Any] | None = None,
    files_root: str = "/tmp/a2a-tasks",
) -> dict[str, Any]:
    """The unsigned card (cleaned)."""
    url = agent_url(public_url, instance.id)
    description = profile.description or (
        f"Coding-agent sandbox VM {instance.id!r}"
        + (f" (loadout {instance.loadout})" if instance.loadout else "")
        + ". Tasks run as PTY sessions on the VM: text is a bash command line for the shell "
        "skill; other skills take a data part that matches their input schema (select one "
        f"with message metadata {SKILL_SELECTOR!r}). Output streams as artifact updates; a "
        "prompt waiting for a person turns the task to input-required."
    )
    skills = []
    schemas: dict[str, str] = {}
    for skill in profile.skills:
        entry: dict[str, Any] = {
            "id": skill.id,
            "name": skill.name,
            "description": skill.description + files_note(files_root),
            "tags": skill.tags or [skill.id],
            "examples": skill.examples,
            "inputModes": [
                "application/json" if skill.input_schema else "text/plain",
                "application/octet-stream",
            ],
            "outputModes": ["text/plain", "application/octet-stream"],
        }
        skills.append(entry)
        if skill.input_schema is not None:
            schemas[skill.id] = json.dumps(
                skill.input_schema, sort_keys=True, separators=(",", ":")
            )
    extensions: list[dict[str, Any]] = []
    if schemas:
        extensions.append(
            {
                "uri": SKILL_SCHEMAS_EXT,
                "description": "JSON Schema (as JSON text) of the data part each skill takes; "
                f"choose the skill with message metadata {SKILL_SELECTOR!r}",
                "params": {"selector": f"message.metadata.{SKILL_SELECTOR}", "schemas": schemas},
            }
        )
    if extended:
        extensions.append(
            {
                "uri": INSTANCE_EXT,
                "description": "Live details of this instance (authenticated callers only)",
                "params": extended,
            }
        )
    card: dict[str, Any] = {
        "name": f"sandbox {instance.id}",
        "description": description,
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": PROTOCOL_VERSION},
            {"url": url, "protocolBinding": "HTTP+JSON", "protocolVersion": PROTOCOL_VERSION},
        ],
        "provider": {"organization": "agentic-sandbox", "url": public_url},
        "version": f"{server_version}+r{instance.version}",
        "capabilities": {
            "streaming": True,
            "pushNotifications": True,
            "extendedAgentCard": True,
            "extensions": extensions,
        },
        "securitySchemes": {
            "apiKey": {
                "httpAuthSecurityScheme": {
                    "scheme": "Bearer",
                    "bearerFormat": "sbk_ API key",
                    "description": "An API key bound to this instance (admin API "
                    "/api/v2/admin/api-keys). Scope a2a:read reads tasks and the extended "
                    "card; a2a:invoke also sends messages, cancels and sets push configs.",
                }
            },
            "operatorToken": {
                "httpAuthSecurityScheme": {
                    "scheme": "Bearer",
                    "bearerFormat": "sbx_ operator token",
                    "description": "An operator token of the instance's owner (or an admin); "
                    "the viewer role reads only.",
                }
            },
        },
        "securityRequirements": [
            {"schemes": {"apiKey": {"list": ["a2a:read", "a2a:invoke"]}}},
            {"schemes": {"operatorToken": {"list": ["operator"]}}},
        ],
        "defaultInputModes": ["text/plain", "application/json", "application/octet-stream"],
        "defaultOutputModes": ["text/plain", "application/octet-stream"],
        "skills": skills,
    }
    cleaned: dict[str, Any] = clean_empty(card)
    return cleaned


@dataclass(frozen=True)
class SignedCard:
    body: bytes
    etag: str
    last_modified: str


class CardCache:
    """Signed cards by instance, rebuilt when the instance (or the key) changes."""

    def __init__(self, keys: InstanceKeys) -> None:
        self.keys = keys
        self._cache: dict[tuple[Any, ...], SignedCard] = {}

    async def signed(
        self,
        card: dict[str, Any],
        *,
        instance: m.Instance,
        cache_key: tuple[Any, ...] | None,
    ) -> SignedCard:
        if cache_key is not None:
            hit = self._cache.get(cache_key)
            if hit is not None:
                return hit
        key = await self.keys.signing_key(instance.id)
        signed = {**card, "signatures": [sign_detached(card, key)]}
        body = json.dumps(signed, ensure_ascii=False, separators=(",", ":")).encode()
        out = SignedCard(
            body=body,
            etag='"' + hashlib.sha256(body).hexdigest()[:32] + '"',
            last_modified=email.utils.format_datetime(instance.updated_at, usegmt=True),
        )
        if cache_key is not None:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[cache_key] = out
        return out
