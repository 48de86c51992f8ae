"""Enrollment tokens and agent certificates.

A token is random (`sbe_…`), shown once, stored as a SHA-256 hash, bound to one incarnation of
one instance, and expires. `enroll` consumes it atomically (a second use is refused even when two
arrive at once) and signs the agent's CSR with a certificate naming the token's instance and
incarnation. `renew` signs a new CSR for the incarnation named by a verified, known, unrevoked
certificate. A token or certificate of an incarnation that has ended (the instance was deleted,
whatever id it has now) is refused. Every refusal has a short machine reason (the metric label
and audit cause) and a message for the agent.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import delete, select, update

from agentic_sandbox.broker.agentlink.ca import (
    CertificateAuthority,
    CertificateError,
    IssuedCertificate,
)
from agentic_sandbox.broker.auth import credentials as cred
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)


class EnrollmentRefused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class IssuedToken:
    id: str
    token: str
    instance_id: str
    incarnation: str
    expires_at: dt.datetime


@dataclass(frozen=True)
class VerifiedAgent:
    """What a verified, live certificate says: whose agent this is."""

    instance_id: str
    incarnation: str


class Enrollment:
    def __init__(self, db: Database, ca: CertificateAuthority, cert_lifetime: dt.timedelta) -> None:
        self._db = db
        self.ca = ca
        self.cert_lifetime = cert_lifetime

    async def create_token(
        self, instance_id: str, ttl: dt.timedelta, incarnation: str | None = None
    ) -> IssuedToken:
        """A one-time token for the instance's live incarnation (`incarnation`, when given,
        must be it: a provision asks for the incarnation it is making)."""
        live = await self._live_incarnation(instance_id)
        if live is None or (incarnation is not None and incarnation != live):
            raise EnrollmentRefused("unknown_instance", f"instance {instance_id!r} is not live")
        secret = cred.new_secret(cred.ENROLL_PREFIX)
        row = m.EnrollmentToken(
            id=cred.new_id(),
            instance_id=instance_id,
            incarnation=live,
            token_hash=cred.digest(secret),
            expires_at=dt.datetime.now(dt.UTC) + ttl,
        )
        async with self._db.session() as s:
            s.add(row)
        return IssuedToken(row.id, secret, instance_id, live, row.expires_at)

    async def _live_incarnation(self, instance_id: str) -> str | None:
        async with self._db.session() as s:
            row = await s.get(m.Instance, instance_id)
            if row is None or row.deleted_at is not None:
                return None
            return row.incarnation

    async def enroll(self, claimed_instance: str, token: str, csr_pem: bytes) -> IssuedCertificate:
        if not token.startswith(cred.ENROLL_PREFIX) or len(token) > 200:
            raise EnrollmentRefused("unknown_token", "not an enrollment token")
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            row = await s.scalar(
                select(m.EnrollmentToken).where(m.EnrollmentToken.token_hash == cred.digest(token))
            )
            if row is None:
                raise EnrollmentRefused("unknown_token", "unknown enrollment token")
            if row.instance_id != claimed_instance:
                raise EnrollmentRefused(
                    "foreign_token", "this enrollment token belongs to another instance"
                )
            if row.used_at is not None:
                raise EnrollmentRefused("reused_token", "this enrollment token was already used")
            if row.expires_at <= now:
                raise EnrollmentRefused("expired_token", "this enrollment token has expired")
            token_id, instance_id, incarnation = row.id, row.instance_id, row.incarnation
        if await self._live_incarnation(instance_id) != incarnation:
            raise EnrollmentRefused(
                "ended_incarnation", "the token's instance was deleted (its incarnation ended)"
            )
        try:
            issued = self.ca.issue_agent(csr_pem, instance_id, incarnation, self.cert_lifetime)
        except CertificateError as exc:
            raise EnrollmentRefused("bad_csr", str(exc)) from None
        async with self._db.session() as s:
            # Consume the token atomically: only one of two concurrent uses wins.
            result = await s.execute(
                update(m.EnrollmentToken)
                .where(m.EnrollmentToken.id == token_id, m.EnrollmentToken.used_at.is_(None))
                .values(used_at=now)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                raise EnrollmentRefused("reused_token", "this enrollment token was already used")
            s.add(self._cert_row(issued))
        return issued

    async def check_certificate(
        self, serial: str, instance_id: str, incarnation: str
    ) -> VerifiedAgent:
        """Refuse a certificate this server did not issue, revoked, expired, or of an ended
        incarnation (the TLS layer has verified the signature chain already; `instance_id` and
        `incarnation` are what the certificate names)."""
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            row = await s.get(m.AgentCertificate, serial)
            if row is None:
                raise EnrollmentRefused("unknown_certificate", "certificate unknown to this server")
            if row.instance_id != instance_id or row.incarnation != incarnation:
                raise EnrollmentRefused(
                    "foreign_certificate", "certificate recorded for another instance"
                )
            if row.revoked_at is not None:
                raise EnrollmentRefused("revoked_certificate", "certificate has been revoked")
            if row.not_after <= now:
                raise EnrollmentRefused("expired_certificate", "certificate has expired")
        if await self._live_incarnation(instance_id) != incarnation:
            raise EnrollmentRefused(
                "ended_incarnation",
                "the certificate's instance was deleted (its incarnation ended)",
            )
        return VerifiedAgent(instance_id, incarnation)

    async def renew(
        self, instance_id: str, incarnation: str, serial: str, csr_pem: bytes
    ) -> IssuedCertificate:
        await self.check_certificate(serial, instance_id, incarnation)
        try:
            issued = self.ca.issue_agent(csr_pem, instance_id, incarnation, self.cert_lifetime)
        except CertificateError as exc:
            raise EnrollmentRefused("bad_csr", str(exc)) from None
        async with self._db.session() as s:
            s.add(self._cert_row(issued))
        return issued

    async def end_incarnation(self, instance_id: str, incarnation: str) -> int:
        """Revoke every certificate of an incarnation and delete its unused tokens (a delete, a
        failed or abandoned provision). Returns the number of certificates revoked."""
        async with self._db.session() as s:
            result = await s.execute(
                update(m.AgentCertificate)
                .where(
                    m.AgentCertificate.instance_id == instance_id,
                    m.AgentCertificate.incarnation == incarnation,
                    m.AgentCertificate.revoked_at.is_(None),
                )
                .values(revoked_at=dt.datetime.now(dt.UTC))
            )
            await s.execute(
                delete(m.EnrollmentToken).where(
                    m.EnrollmentToken.instance_id == instance_id,
                    m.EnrollmentToken.incarnation == incarnation,
                    m.EnrollmentToken.used_at.is_(None),
                )
            )
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    @staticmethod
    def _cert_row(issued: IssuedCertificate) -> m.AgentCertificate:
        return m.AgentCertificate(
            serial=issued.serial,
            instance_id=issued.instance_id,
            incarnation=issued.incarnation,
            not_before=issued.not_before,
            not_after=issued.not_after,
        )
