"""Operator tokens, dashboard sessions and agent-bound API keys."""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, func, select, update

from agentic_sandbox.broker.auth import credentials as cred
from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.auth.streams import LiveStreams
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)

CACHE_SECONDS = 5.0
LAST_USED_EVERY = dt.timedelta(minutes=1)
A2A_SCOPES = frozenset({"a2a:read", "a2a:invoke"})


@dataclass(frozen=True)
class IssuedCredential:
    """A freshly made token or key: the only moment its plaintext exists."""

    id: str
    secret: str


class AuthService:
    """Credentials: issue, resolve, revoke. Revoking one also ends every WebSocket and SSE
    stream opened with it (`streams`), at once."""

    def __init__(
        self, db: Database, streams: LiveStreams, *, web_session_ttl: int = 12 * 3600
    ) -> None:
        self._db = db
        self.streams = streams
        self._ttl = dt.timedelta(seconds=web_session_ttl)
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    def invalidate(self) -> None:
        self._cache.clear()

    # ---- bootstrap ------------------------------------------------------------------------
    async def ensure_bootstrap_admin(self, token_file: Path) -> Path | None:
        """With no usable admin token, make one and write it (0600) to `token_file`."""
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            count = await s.scalar(
                select(func.count())
                .select_from(m.OperatorToken)
                .where(
                    m.OperatorToken.role == Role.admin.value,
                    m.OperatorToken.revoked_at.is_(None),
                    (m.OperatorToken.expires_at.is_(None)) | (m.OperatorToken.expires_at > now),
                )
            )
        if count:
            return None
        issued = await self.create_token(
            subject="admin", role=Role.admin, description="bootstrap admin", created_by=None
        )
        token_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = token_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(issued.secret + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, token_file)
        return token_file

    # ---- operator tokens ------------------------------------------------------------------
    async def create_token(
        self,
        *,
        subject: str,
        role: Role,
        description: str = "",
        created_by: str | None,
        expires_at: dt.datetime | None = None,
    ) -> IssuedCredential:
        secret = cred.new_secret(cred.OPERATOR_PREFIX)
        row = m.OperatorToken(
            id=cred.new_id(),
            subject=subject,
            role=role.value,
            description=description,
            token_hash=cred.digest(secret),
            prefix=cred.display_prefix(secret),
            created_by=created_by,
            expires_at=expires_at,
        )
        async with self._db.session() as s:
            s.add(row)
        return IssuedCredential(row.id, secret)

    async def list_tokens(self, subject: str | None = None) -> list[m.OperatorToken]:
        stmt = select(m.OperatorToken).order_by(m.OperatorToken.created_at)
        if subject is not None:
            stmt = stmt.where(m.OperatorToken.subject == subject)
        async with self._db.session() as s:
            return list((await s.scalars(stmt)).all())

    async def get_token(self, token_id: str) -> m.OperatorToken | None:
        async with self._db.session() as s:
            return await s.get(m.OperatorToken, token_id)

    async def revoke_token(self, token_id: str) -> bool:
        async with self._db.session() as s:
            row = await s.get(m.OperatorToken, token_id)
            if row is None:
                return False
            if row.revoked_at is None:
                row.revoked_at = dt.datetime.now(dt.UTC)
            await s.execute(
                update(m.WebSession)
                .where(m.WebSession.token_id == token_id)
                .values(expires_at=dt.datetime.now(dt.UTC))
            )
        self.invalidate()
        # Cookies made from the token lease their streams under the token too.
        self.streams.revoke(f"token:{token_id}", "token revoked")
        return True

    async def resolve_bearer(self, secret: str) -> Principal | None:
        """The principal for an operator token or API key, or None if unusable."""
        if not secret.startswith((cred.OPERATOR_PREFIX, cred.APIKEY_PREFIX)) or len(secret) > 200:
            return None
        key = cred.digest(secret)
        hit = self._cache.get(key)
        now_mono = time.monotonic()
        if hit is not None and now_mono - hit[0] < CACHE_SECONDS:
            return hit[1]
        principal = await (
            self._load_token(key)
            if secret.startswith(cred.OPERATOR_PREFIX)
            else self._load_key(key)
        )
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key] = (now_mono, principal)
        return principal

    async def _load_token(self, token_hash: str) -> Principal | None:
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            row = await s.scalar(
                select(m.OperatorToken).where(m.OperatorToken.token_hash == token_hash)
            )
            if row is None or row.revoked_at is not None:
                return None
            if row.expires_at is not None and row.expires_at <= now:
                return None
            if row.last_used_at is None or now - row.last_used_at > LAST_USED_EVERY:
                row.last_used_at = now
            return Principal(
                subject=row.subject,
                role=Role(row.role),
                kind="token",
                credential_id=row.id,
                expires_at=row.expires_at,
            )

    async def _live_incarnation(self, instance_id: str) -> str | None:
        async with self._db.session() as s:
            return await s.scalar(
                select(m.Instance.incarnation).where(
                    m.Instance.id == instance_id, m.Instance.deleted_at.is_(None)
                )
            )

    async def _load_key(self, key_hash: str) -> Principal | None:
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            row = await s.scalar(select(m.ApiKey).where(m.ApiKey.key_hash == key_hash))
            if row is None or row.revoked_at is not None:
                return None
            if row.expires_at is not None and row.expires_at <= now:
                return None
            live = await s.scalar(
                select(m.Instance.incarnation).where(
                    m.Instance.id == row.instance_id, m.Instance.deleted_at.is_(None)
                )
            )
            if live != row.incarnation:  # the key's instance was deleted (whatever has its id)
                return None
            if row.last_used_at is None or now - row.last_used_at > LAST_USED_EVERY:
                row.last_used_at = now
            return Principal(
                subject=row.owner,
                role=Role.viewer,
                kind="apikey",
                credential_id=row.id,
                scopes=frozenset(row.scopes or ()),
                instance_id=row.instance_id,
                expires_at=row.expires_at,
            )

    # ---- dashboard sessions ---------------------------------------------------------------
    async def login(self, secret: str) -> tuple[str, str, Principal] | None:
        """Exchange an operator token for a cookie value and a CSRF token."""
        principal = await self.resolve_bearer(secret)
        if principal is None or principal.kind != "token":
            return None
        cookie = cred.new_secret("sbs_")
        csrf = cred.new_secret("")
        async with self._db.session() as s:
            s.add(
                m.WebSession(
                    id_hash=cred.digest(cookie),
                    token_id=principal.credential_id,
                    csrf_token=csrf,
                    expires_at=dt.datetime.now(dt.UTC) + self._ttl,
                )
            )
        return cookie, csrf, principal

    async def resolve_cookie(self, cookie: str) -> tuple[Principal, str] | None:
        if not cookie.startswith("sbs_") or len(cookie) > 200:
            return None
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            ws = await s.get(m.WebSession, cred.digest(cookie))
            if ws is None or ws.expires_at <= now:
                return None
            tok = await s.get(m.OperatorToken, ws.token_id)
            if tok is None or tok.revoked_at is not None:
                return None
            if tok.expires_at is not None and tok.expires_at <= now:
                return None
            expiry = [t for t in (ws.expires_at, tok.expires_at) if t is not None]
            principal = Principal(
                subject=tok.subject,
                role=Role(tok.role),
                kind="cookie",
                credential_id=tok.id,
                web_session=ws.id_hash,
                expires_at=min(expiry) if expiry else None,
            )
            return principal, ws.csrf_token

    async def logout(self, cookie: str) -> None:
        session_id = cred.digest(cookie)
        async with self._db.session() as s:
            ws = await s.get(m.WebSession, session_id)
            if ws is not None:
                await s.delete(ws)
        self.streams.revoke(f"web:{session_id}", "signed out")

    # ---- agent-bound API keys (A2A) -------------------------------------------------------
    async def create_api_key(
        self,
        *,
        instance_id: str,
        owner: str,
        scopes: frozenset[str],
        name: str = "",
        expires_at: dt.datetime | None = None,
    ) -> IssuedCredential:
        unknown = scopes - A2A_SCOPES
        if unknown:
            raise ValueError(f"unknown scopes: {', '.join(sorted(unknown))}")
        incarnation = await self._live_incarnation(instance_id)
        if incarnation is None:
            raise LookupError(f"no live instance {instance_id!r}")
        secret = cred.new_secret(cred.APIKEY_PREFIX)
        row = m.ApiKey(
            id=cred.new_id(),
            instance_id=instance_id,
            incarnation=incarnation,
            owner=owner,
            name=name,
            scopes=sorted(scopes),
            key_hash=cred.digest(secret),
            prefix=cred.display_prefix(secret),
            expires_at=expires_at,
        )
        async with self._db.session() as s:
            s.add(row)
        return IssuedCredential(row.id, secret)

    async def list_api_keys(
        self, owner: str | None = None, instance_id: str | None = None
    ) -> list[m.ApiKey]:
        stmt = select(m.ApiKey).order_by(m.ApiKey.created_at)
        if owner is not None:
            stmt = stmt.where(m.ApiKey.owner == owner)
        if instance_id is not None:
            stmt = stmt.where(m.ApiKey.instance_id == instance_id)
        async with self._db.session() as s:
            return list((await s.scalars(stmt)).all())

    async def get_api_key(self, key_id: str) -> m.ApiKey | None:
        async with self._db.session() as s:
            return await s.get(m.ApiKey, key_id)

    async def end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's A2A keys are revoked (their open streams end) and its shares
        removed."""
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            keys = list(
                await s.scalars(
                    update(m.ApiKey)
                    .where(
                        m.ApiKey.instance_id == ended.instance_id,
                        m.ApiKey.incarnation == ended.incarnation,
                        m.ApiKey.revoked_at.is_(None),
                    )
                    .values(revoked_at=now)
                    .returning(m.ApiKey.id)
                )
            )
            await s.execute(
                delete(m.Share).where(
                    m.Share.object_type == "instance", m.Share.object_id == ended.instance_id
                )
            )
        self.invalidate()
        for key_id in keys:
            self.streams.revoke(f"apikey:{key_id}", "the key's instance was deleted")

    async def revoke_api_key(self, key_id: str) -> bool:
        async with self._db.session() as s:
            row = await s.get(m.ApiKey, key_id)
            if row is None:
                return False
            if row.revoked_at is None:
                row.revoked_at = dt.datetime.now(dt.UTC)
        self.invalidate()
        self.streams.revoke(f"apikey:{key_id}", "API key revoked")
        return True
