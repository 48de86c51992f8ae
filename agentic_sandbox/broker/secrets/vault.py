"""Write-only secrets, encrypted at rest with a key file in the data directory.

Values are sealed with Fernet (AES-128-CBC + HMAC-SHA256, from `cryptography`) under a key kept
in `<data_dir>/secrets.key` (mode 0600, created on first start). The API never returns a value
after it is set; the server decrypts only to hand values to an instance (environment of its
sessions) and to teach the redactor what to mask in logs, events, recordings and observer streams.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import delete, select

from agentic_sandbox.broker.auth.credentials import new_id
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.observability.logs import redactor
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store.rowcache import RowCache

SECRET_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")


class VaultError(Exception):
    pass


def load_or_create_key(path: Path) -> bytes:
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            os.chmod(path, 0o600)
        key = path.read_bytes().strip()
        try:
            Fernet(key)
        except ValueError as exc:
            raise VaultError(f"{path} is not a valid key file: {exc}") from None
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Fernet.generate_key()
    # Written aside, then linked into place: nodes sharing a data dir that start together
    # agree on one key (the loser of the link reads the winner's), never a half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return load_or_create_key(path)
    finally:
        tmp.unlink(missing_ok=True)
    return key


class Vault:
    def __init__(self, db: Database, key_file: Path) -> None:
        self._db = db
        self._fernet = Fernet(load_or_create_key(key_file))
        # What every session's start reads: an instance's bindings, as (env name, ciphertext)
        # pairs — kept sealed, opened per use — until this process writes one of the joined
        # tables (SQLite; on PostgreSQL every call reads)
        self._bound: RowCache[tuple[tuple[str, bytes], ...]] = RowCache(
            db,
            (m.Secret.__tablename__, m.SecretBinding.__tablename__, m.Instance.__tablename__),
            self._read_bound,
        )

    def seal(self, value: bytes) -> bytes:
        return self._fernet.encrypt(value)

    def open(self, token: bytes) -> bytes:
        try:
            return self._fernet.decrypt(token)
        except InvalidToken:
            raise VaultError("ciphertext does not match this data directory's key") from None

    async def teach_redactor(self) -> int:
        """Register every stored value with the redactor (at start-up)."""
        async with self._db.session() as s:
            rows = (await s.scalars(select(m.Secret))).all()
        values = []
        for row in rows:
            try:
                values.append(self.open(row.ciphertext).decode("utf-8", "replace"))
            except VaultError:
                continue
        redactor.add(values)
        return len(values)

    async def put(self, owner: str, name: str, value: str) -> tuple[m.Secret, bool]:
        """Create or replace; returns the row and whether it was created."""
        if not SECRET_NAME_RE.match(name):
            raise VaultError("name must match [A-Za-z_][A-Za-z0-9_.-]{0,127}")
        redactor.add([value])
        sealed = self.seal(value.encode())
        async with self._db.session() as s:
            row = await s.scalar(
                select(m.Secret).where(m.Secret.owner == owner, m.Secret.name == name)
            )
            if row is None:
                row = m.Secret(id=new_id(), owner=owner, name=name, ciphertext=sealed)
                s.add(row)
                return row, True
            row.ciphertext = sealed
            row.version += 1
            return row, False

    async def value_of(self, owner: str, name: str) -> str | None:
        """The value of `owner`'s secret `name` (server-side use only: the egress proxy's
        brokered credentials), or None when there is none."""
        async with self._db.session() as s:
            row = await s.scalar(
                select(m.Secret).where(m.Secret.owner == owner, m.Secret.name == name)
            )
        if row is None:
            return None
        return self.open(row.ciphertext).decode()

    async def exists(self, owner: str, name: str) -> bool:
        async with self._db.session() as s:
            found = await s.scalar(
                select(m.Secret.id).where(m.Secret.owner == owner, m.Secret.name == name)
            )
        return found is not None

    async def values_for_instance(self, instance_id: str) -> dict[str, str]:
        """Environment name → value of the secrets bound to an instance's live incarnation
        (server-side use only): a binding made for an earlier instance with this id never
        applies."""
        bound = await self._bound.get(instance_id)
        return {name: self.open(sealed).decode() for name, sealed in bound or ()}

    async def _read_bound(self, instance_id: str) -> tuple[tuple[str, bytes], ...]:
        async with self._db.session() as s:
            rows = (
                await s.execute(
                    select(m.Secret, m.SecretBinding)
                    .join(m.SecretBinding, m.SecretBinding.secret_id == m.Secret.id)
                    .join(
                        m.Instance,
                        (m.Instance.id == m.SecretBinding.instance_id)
                        & (m.Instance.incarnation == m.SecretBinding.incarnation),
                    )
                    .where(
                        m.SecretBinding.instance_id == instance_id,
                        m.Instance.deleted_at.is_(None),
                    )
                )
            ).all()
        return tuple(
            (binding.env_name or secret.name, secret.ciphertext) for secret, binding in rows
        )

    async def end_incarnation(self, ended: EndedIncarnation) -> None:
        """An ended incarnation's secret bindings are removed (the secrets stay their owner's)."""
        async with self._db.session() as s:
            await s.execute(
                delete(m.SecretBinding).where(
                    m.SecretBinding.instance_id == ended.instance_id,
                    m.SecretBinding.incarnation == ended.incarnation,
                )
            )
