"""Enrollment tokens and agent certificates.

A token is random (`sbe_…`), shown once, stored as a SHA-256 hash, bound to one instance, and
expires. `enroll` consumes it atomically (a second use is refused even when two arrive at once)
and signs the agent's CSR with a certificate naming the token's instance. `renew` signs a new CSR
for the instance named by a verified, known, unrevoked certificate. Every refusal has a short
machine reason (the metric label and audit cause) and a message for the agent.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import select, update

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
    expires_at: dt.datetime


class Enrollment:
    def __init__(self, db: Database, ca: CertificateAuthority, cert_lifetime: dt.timedelta) -> None:
        self._db = db
        self.ca = ca
        self.cert_lifetime = cert_lifetime

    async def create_token(self, instance_id: str, ttl: dt.timedelta) -> IssuedToken:
        secret = cred.new_secret(cred.ENROLL_PREFIX)
        row = m.EnrollmentToken(
            id=cred.new_id(),
            instance_id=instance_id,
            token_hash=cred.digest(secret),
            expires_at=dt.datetime.now(dt.UTC) + ttl,
        )
        async with self._db.session() as s:
            s.add(row)
        return IssuedToken(row.id, secret, instance_id, row.expires_at)

    async def _instance_live(self, instance_id: str) -> bool:
        async with self._db.session() as s:
            row = await s.get(m.Instance, instance_id)
            return row is not None and row.deleted_at is None

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
            token_id, instance_id = row.id, row.instance_id
        if not await self._instance_live(instance_id):
            raise EnrollmentRefused("unknown_instance", "the token's instance no longer exists")
        try:
            issued = self.ca.issue_agent(csr_pem, instance_id, self.cert_lifetime)
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

    async def check_certificate(self, serial: str, instance_id: str) -> None:
        """Refuse a certificate this server did not issue, revoked, expired or for a deleted
        instance (the TLS layer has verified the signature chain already)."""
        now = dt.datetime.now(dt.UTC)
        async with self._db.session() as s:
            row = await s.get(m.AgentCertificate, serial)
            if row is None:
                raise EnrollmentRefused("unknown_certificate", "certificate unknown to this server")
            if row.instance_id != instance_id:
                raise EnrollmentRefused(
                    "foreign_certificate", "certificate recorded for another instance"
                )
            if row.revoked_at is not None:
                raise EnrollmentRefused("revoked_certificate", "certificate has been revoked")
            if row.not_after <= now:
                raise EnrollmentRefused("expired_certificate", "certificate has expired")
        if not await self._instance_live(instance_id):
            raise EnrollmentRefused("unknown_instance", "the certificate's instance is gone")

    async def renew(self, instance_id: str, serial: str, csr_pem: bytes) -> IssuedCertificate:
        await self.check_certificate(serial, instance_id)
        try:
            issued = self.ca.issue_agent(csr_pem, instance_id, self.cert_lifetime)
        except CertificateError as exc:
            raise EnrollmentRefused("bad_csr", str(exc)) from None
        async with self._db.session() as s:
            s.add(self._cert_row(issued))
        return issued

    async def revoke_instance(self, instance_id: str) -> int:
        """Revoke every certificate of an instance (e.g. when it is deleted)."""
        async with self._db.session() as s:
            result = await s.execute(
                update(m.AgentCertificate)
                .where(
                    m.AgentCertificate.instance_id == instance_id,
                    m.AgentCertificate.revoked_at.is_(None),
                )
                .values(revoked_at=dt.datetime.now(dt.UTC))
            )
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    @staticmethod
    def _cert_row(issued: IssuedCertificate) -> m.AgentCertificate:
        return m.AgentCertificate(
            serial=issued.serial,
            instance_id=issued.instance_id,
            not_before=issued.not_before,
            not_after=issued.not_after,
        )
