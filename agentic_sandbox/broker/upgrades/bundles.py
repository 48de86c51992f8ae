"""The agent bundles a rollout can send: the server's own (built from its files, as a provision
ships it) and the ones an admin uploaded, kept in the database by digest."""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass

from sqlalchemy import select

from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision import AgentBundle, BundleError, bundle_digest, bundle_version

MAX_UPLOAD = 32 * 1024 * 1024  # an uploaded bundle (an agent takes up to 64 MiB)


@dataclass(frozen=True)
class StoredBundle:
    digest: str
    version: str
    size: int
    builtin: bool
    data: bytes = b""  # empty in a listing
    created_by: str = ""
    created_at: dt.datetime | None = None


class BundleRejected(Exception):
    """An uploaded bundle that an agent could not run (why, for the caller)."""


class BundleStore:
    def __init__(self, svc: Services) -> None:
        self._svc = svc
        self._own = AgentBundle()
        self._builtin: StoredBundle | None = None

    async def builtin(self) -> StoredBundle:
        """The server's own agent bundle, checked (a clean interpreter imports it)."""
        data = await asyncio.to_thread(self._own.checked)
        digest = bundle_digest(data)
        if self._builtin is None or self._builtin.digest != digest:
            version = await asyncio.to_thread(bundle_version, data)
            self._builtin = StoredBundle(digest, version, len(data), True, data)
        return self._builtin

    async def add(self, data: bytes, actor: str) -> tuple[StoredBundle, bool]:
        """Check and keep `data` (the bundle, and True when it is new)."""
        digest = bundle_digest(data)
        found = await self.get(digest)
        if found is not None:
            return found, False
        try:
            version = await asyncio.to_thread(bundle_version, data)
            await asyncio.to_thread(self._own.check, data)
        except BundleError as exc:
            raise BundleRejected(str(exc)) from None
        now = dt.datetime.now(dt.UTC)
        async with self._svc.db.session() as s:
            if await s.get(m.AgentBundle, digest) is None:
                s.add(
                    m.AgentBundle(
                        digest=digest,
                        version=version,
                        size=len(data),
                        data=data,
                        created_by=actor[:128],
                        created_at=now,
                    )
                )
        return StoredBundle(digest, version, len(data), False, data, actor[:128], now), True

    async def get(self, digest: str) -> StoredBundle | None:
        own = await self.builtin()
        if own.digest == digest:
            return own
        async with self._svc.db.session() as s:
            row = await s.get(m.AgentBundle, digest)
            if row is None:
                return None
            return StoredBundle(
                row.digest, row.version, row.size, False, row.data, row.created_by, row.created_at
            )

    async def all(self) -> list[StoredBundle]:
        """The server's own first, then the uploaded ones, newest first (without their data)."""
        own = await self.builtin()
        async with self._svc.db.session() as s:
            rows = (
                await s.execute(
                    select(
                        m.AgentBundle.digest,
                        m.AgentBundle.version,
                        m.AgentBundle.size,
                        m.AgentBundle.created_by,
                        m.AgentBundle.created_at,
                    ).order_by(m.AgentBundle.created_at.desc())
                )
            ).all()
        out = [own]
        for digest, version, size, by, at in rows:
            if digest != own.digest:
                out.append(StoredBundle(digest, version, size, False, b"", by, at))
        return out
