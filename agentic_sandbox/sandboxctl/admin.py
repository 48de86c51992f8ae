"""Verbs of access and observation: whoami, token, secret, event, audit, agentcard."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agentic_sandbox.sandboxctl.exits import EXIT_USAGE, CliError
from agentic_sandbox.sandboxctl.output import doc, emit
from agentic_sandbox.sandboxctl.parsing import Nouns
from agentic_sandbox.sdk import AsyncClient, Event

TOKEN_COLS = ["id", "subject", "role", "prefix", "created_at", "expires_at", "revoked_at"]
AUDIT_COLS = [
    "id",
    "time",
    "actor",
    "action",
    "subject_type",
    "subject_id",
    "outcome",
    "from_state",
    "to_state",
    "cause",
]


async def whoami(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.whoami()), a.output)


# ---- tokens and secrets ------------------------------------------------------------------------
async def token_create(c: AsyncClient, a: argparse.Namespace) -> None:
    created = await c.tokens.create(
        a.subject, role=a.role, description=a.description, expires_in_seconds=a.expires_in
    )
    if a.output == "table":
        print(created.token)
        print(
            f"(token {created.id} for {created.subject} as {created.role}; "
            "shown once — store it now)",
            file=sys.stderr,
        )
    else:
        emit(doc(created), a.output)


async def token_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(doc(await c.tokens.list()), a.output, TOKEN_COLS)


async def token_revoke(c: AsyncClient, a: argparse.Namespace) -> None:
    await c.tokens.revoke(a.token_id)
    print(f"revoked {a.token_id}")


async def secret_set(c: AsyncClient, a: argparse.Namespace) -> None:
    if a.from_file:
        value = Path(a.from_file).read_text()
    elif a.value == "-":
        value = sys.stdin.read()
    else:
        value = a.value
    info = await c.secrets.set(a.name, value, instances=a.instance or [], env_name=a.env)
    emit(doc(info), a.output)


async def secret_list(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(
        doc(await c.secrets.list()),
        a.output,
        ["name", "owner", "version", "instances", "updated_at"],
    )


async def secret_delete(c: AsyncClient, a: argparse.Namespace) -> None:
    await c.secrets.delete(a.name)
    print(f"deleted {a.name}")


# ---- events and audit --------------------------------------------------------------------------
async def event_tail(c: AsyncClient, a: argparse.Namespace) -> None:
    filters: dict[str, Any] = {"types": a.type, "instance_id": a.instance}
    if not a.follow:
        page = await c.events.page(after=a.after, limit=a.limit, **filters)
        _print_events(page.items, a.output)
        return
    async for ev in c.events.follow(after=a.after, **filters):
        _print_events([ev], a.output)


def _print_events(items: list[Event], fmt: str) -> None:
    for event in items:
        ev = event.to_dict()
        if fmt == "json":
            print(json.dumps(ev), flush=True)
        else:
            subject = ev.get("instance_id") or ev.get("session_id") or ev.get("task_id") or ""
            data = json.dumps(ev.get("data", {}), separators=(",", ":"))
            print(
                f"{ev['seq']:>8} {ev['time'][:19]} {ev['type']:<28} {subject:<20} {data}",
                flush=True,
            )


async def audit_list(c: AsyncClient, a: argparse.Namespace) -> None:
    page = await c.audit.page(
        subject_type=a.subject_type,
        subject_id=a.subject_id,
        actor=a.actor,
        outcome=a.outcome,
        after=a.after,
        limit=a.limit,
    )
    if a.output == "table" and page.items:
        print(f"(next page: --after {page.next})", file=sys.stderr)
    emit(page.to_dict(), a.output, AUDIT_COLS)


# ---- agent cards -------------------------------------------------------------------------------
async def agentcard_get(c: AsyncClient, a: argparse.Namespace) -> None:
    emit(await c.agentcards.get(a.id), a.output)


async def agentcard_verify(c: AsyncClient, a: argparse.Namespace) -> None:
    card: dict[str, Any] | None = None
    if a.card:
        try:
            card = json.loads(Path(a.card).read_text())
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read the card {a.card}: {exc}", EXIT_USAGE) from None
    verified = await c.agentcards.verify(a.id, card)
    provider = verified.card.get("provider") or {}
    emit(
        {
            "verified": True,
            "instance": a.id,
            "card": f"{verified.card.get('name')} {verified.card.get('version', '')}".strip(),
            "signed_by": {
                "kid": verified.kid,
                "algorithm": verified.header.get("alg"),
                "key": f"{verified.jwk.get('kty')} {verified.jwk.get('crv', '')}".strip(),
                "jwks": verified.jwks_url,
            },
            "provider": provider.get("organization") if isinstance(provider, dict) else provider,
        },
        a.output,
    )


def register(nouns: Nouns) -> None:
    verb = nouns.verb
    nouns.single("whoami", whoami, "who the token is")

    g = nouns.noun("secret", "write-only secrets")
    v = verb(g, "set", secret_set, "set a secret (value, '-' for stdin, or --from-file)")
    v.add_argument("name")
    v.add_argument("value", nargs="?", default="-")
    v.add_argument("--from-file")
    v.add_argument("--instance", action="append", help="bind to an instance (repeatable)")
    v.add_argument("--env", help="variable name in the instance")
    verb(g, "list", secret_list, "list secrets (never values)")
    verb(g, "delete", secret_delete, "delete a secret").add_argument("name")

    g = nouns.noun("token", "operator tokens")
    v = verb(g, "create", token_create, "create a token (printed once)")
    v.add_argument("--subject", required=True)
    v.add_argument("--role", choices=["admin", "operator", "viewer"], default="operator")
    v.add_argument("--description", default="")
    v.add_argument("--expires-in", type=int, help="seconds")
    verb(g, "list", token_list, "list tokens")
    verb(g, "revoke", token_revoke, "revoke a token").add_argument("token_id")

    g = nouns.noun("event", "the event stream")
    v = verb(g, "tail", event_tail, "print events (follow with -f)")
    v.add_argument("-f", "--follow", action="store_true")
    v.add_argument("--after", type=int, default=0)
    v.add_argument("--limit", type=int, default=100)
    v.add_argument("--type", action="append", help="type or family, e.g. instance.*")
    v.add_argument("--instance")

    g = nouns.noun("audit", "the audit log")
    v = verb(g, "list", audit_list, "audit entries, oldest first (filters combine)")
    v.add_argument("--subject-type", help="instance, session, task, token, secret, pool, …")
    v.add_argument("--subject-id")
    v.add_argument("--actor", help="e.g. token:admin")
    v.add_argument("--outcome", choices=["ok", "denied", "failed"])
    v.add_argument("--after", type=int, default=0, help="entries after this id")
    v.add_argument("--limit", type=int, default=100)

    g = nouns.noun("agentcard", "an instance's signed A2A AgentCard")
    verb(g, "get", agentcard_get, "print the AgentCard").add_argument("id")
    v = verb(g, "verify", agentcard_verify, "check the card's signature against the JWKS")
    v.add_argument("id")
    v.add_argument("--card", help="verify this card file instead of the published one")
