"""Loadouts in the server: versioned records in the store, the shipped files as version 1.

What a version is: an increasing integer per name (1, 2, 3, …) plus the digest of its content.
The content is the *document* `{"spec": <the spec as saved, its name set>, "extends_version":
<the parent version it was pinned to, or null>}`; the digest is the SHA-256 of its canonical
JSON (RFC 8785), so saving identical content again finds the same version, and a spec whose
parent has moved on is new content. A version is immutable: its document, digest and resolved
loadout (with `extends` applied) never change. One version per name is active (the pointer
`loadouts.active_version`); a save never moves it, except the first save of a name, whose
version 1 is active at once. Activating is a compare-and-set in one UPDATE statement.

`extends` resolves to the parent's active version at save time and records which one; a save
is validated with the loadout schema itself (`provision.Loadout`), a problem naming the field.

Owners: a name belongs to the operator who first saved it; an admin may save it as shared.
Shared names (the shipped files among them) are read by everyone and changed only by admins;
a non-admin sees and changes only their own, and an admin everything. Instances and warm pools
take the exact version (`Resolved`): the active one when none is named.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rfc8785
from sqlalchemy import and_, func, select, update
from sqlalchemy.exc import IntegrityError

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.errors import (
    ConflictError,
    ForbiddenError,
    InvalidInput,
    NotFoundError,
)
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision import Loadout, LoadoutCatalog, LoadoutError, extend, load_catalog

log = logging.getLogger(__name__)

SYSTEM = "system"
SAVE_ATTEMPTS = 5  # concurrent saves of one name race for the next number; the loser retries


def canonical_digest(document: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of `document`'s RFC 8785 canonical JSON: equal content, equal digest,
    whatever the key order or number spelling. Raises ValueError for what JSON cannot hold
    canonically (integers beyond 2**53, non-finite floats)."""
    try:
        canonical = rfc8785.dumps(dict(document))
    except (rfc8785.CanonicalizationError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    return hashlib.sha256(canonical).hexdigest()


def version_document(spec: Mapping[str, Any], extends_version: int | None) -> dict[str, Any]:
    return {"spec": dict(spec), "extends_version": extends_version}


@dataclass(frozen=True)
class Resolved:
    """The loadout an instance or pool is made with, and the version it is (None: inline)."""

    loadout: Loadout
    version: int | None = None
    digest: str | None = None


@dataclass(frozen=True)
class Saved:
    head: m.Loadout
    version: m.LoadoutVersion
    created: bool  # false: identical content was saved before (this is that version)


def _visible(who: Principal, head: m.Loadout) -> bool:
    return who.is_admin or head.shared or head.owner == who.subject


def _require_change(who: Principal, head: m.Loadout) -> None:
    if who.is_admin:
        return
    if head.shared:
        raise ForbiddenError(f"loadout {head.name!r} is shared: only admins change it")
    if head.owner != who.subject:  # invisible: callers check `_visible` first
        raise NotFoundError("loadout", head.name)


class Loadouts:
    def __init__(self, svc: Services, folder: Path) -> None:
        self._svc = svc
        # the files (shipped, plus the server's loadouts folder): version 1 of their names
        self.catalog: LoadoutCatalog = load_catalog([folder])

    # ---- the shipped files -----------------------------------------------------------------------
    async def seed(self) -> None:
        """Record each file's loadout as version 1 of its name (shared, owned by `system`),
        parents first; a name the store has already is left as it is (a changed file is
        not a new version: save one through the API)."""
        done: set[str] = set()

        async def one(name: str) -> None:
            if name in done:
                return
            done.add(name)
            raw = self.catalog.raw(name)
            parent = raw.get("extends")
            if isinstance(parent, str):
                await one(parent)
            async with self._svc.db.session() as s:
                if await s.get(m.Loadout, name) is not None:
                    return
                document = version_document(raw, 1 if isinstance(parent, str) else None)
                try:
                    digest = canonical_digest(document)
                except ValueError as exc:
                    log.error("loadout file %s: %s; not recorded", name, exc)
                    return
                s.add(m.Loadout(name=name, source="builtin", owner=SYSTEM, shared=True))
                await s.flush()
                s.add(
                    m.LoadoutVersion(
                        name=name,
                        version=1,
                        digest=digest,
                        document=document,
                        resolved=self.catalog.resolve(name).model_dump(mode="json"),
                        extends_name=parent if isinstance(parent, str) else None,
                        extends_version=1 if isinstance(parent, str) else None,
                        created_by=SYSTEM,
                    )
                )

        for name in self.catalog.names():
            try:
                await one(name)
            except IntegrityError:  # another server sharing the store seeded it first
                continue

    # ---- read ------------------------------------------------------------------------------------
    async def heads(self, who: Principal) -> list[tuple[m.Loadout, m.LoadoutVersion]]:
        """Every loadout the caller sees, with its active version, by name."""
        stmt = (
            select(m.Loadout, m.LoadoutVersion)
            .join(
                m.LoadoutVersion,
                and_(
                    m.LoadoutVersion.name == m.Loadout.name,
                    m.LoadoutVersion.version == m.Loadout.active_version,
                ),
            )
            .order_by(m.Loadout.name)
        )
        if not who.is_admin:
            stmt = stmt.where(m.Loadout.shared.is_(True) | (m.Loadout.owner == who.subject))
        async with self._svc.db.session() as s:
            return [(h, v) for h, v in (await s.execute(stmt)).all()]

    async def head(self, who: Principal, name: str) -> m.Loadout:
        async with self._svc.db.session() as s:
            head = await s.get(m.Loadout, name)
        if head is None or not _visible(who, head):
            raise NotFoundError("loadout", name)
        return head

    async def active(self, who: Principal, name: str) -> tuple[m.Loadout, m.LoadoutVersion]:
        head = await self.head(who, name)
        return head, await self.version(who, name, head.active_version)

    async def versions(self, who: Principal, name: str) -> tuple[m.Loadout, list[m.LoadoutVersion]]:
        head = await self.head(who, name)
        async with self._svc.db.session() as s:
            rows = await s.scalars(
                select(m.LoadoutVersion)
                .where(m.LoadoutVersion.name == name)
                .order_by(m.LoadoutVersion.version)
            )
            return head, list(rows.all())

    async def version(self, who: Principal, name: str, version: int) -> m.LoadoutVersion:
        await self.head(who, name)
        async with self._svc.db.session() as s:
            row = await s.get(m.LoadoutVersion, (name, version))
        if row is None:
            raise NotFoundError("loadout version", f"{name}@{version}")
        return row

    # ---- save ------------------------------------------------------------------------------------
    async def save(
        self, who: Principal, name: str, spec: Mapping[str, Any], *, shared: bool = False
    ) -> Saved:
        """Validate `spec` and record it as a version of `name`: the version with identical
        content if there is one (`created` false), else the next number. `shared` (admins
        only) applies to the first save of a name, which decides its owner."""
        if shared and not who.is_admin:
            raise ForbiddenError("only admins save shared loadouts")
        given = spec.get("name", name)
        if given != name:
            raise InvalidInput("spec.name", f"is {given!r}, but the loadout saved is {name!r}")
        doc_spec = {**spec, "name": name}
        parent_name = doc_spec.get("extends")
        parent: Resolved | None = None
        if parent_name is not None:
            if not isinstance(parent_name, str):
                raise InvalidInput("spec.extends", "must be a loadout name")
            if parent_name == name:
                raise InvalidInput("spec.extends", "a loadout cannot extend itself")
            try:
                parent = await self.resolve(who, parent_name)
            except InvalidInput:
                raise InvalidInput(
                    "spec.extends", f"unknown loadout {parent_name!r}", summary="unknown loadout"
                ) from None
        try:
            loadout = extend(parent.loadout if parent else None, doc_spec, name)
        except LoadoutError as exc:
            field = f"spec.{exc.field}" if exc.field else "spec"
            raise InvalidInput(field, str(exc).split(": ", 1)[-1]) from None
        document = version_document(doc_spec, parent.version if parent else None)
        try:
            digest = canonical_digest(document)
        except ValueError as exc:
            raise InvalidInput("spec", f"not canonical JSON: {exc}") from None
        for attempt in range(SAVE_ATTEMPTS):
            try:
                saved = await self._record(
                    who, name, document, digest, loadout, parent_name, parent, shared
                )
            except IntegrityError:
                if attempt == SAVE_ATTEMPTS - 1:
                    raise ConflictError(
                        f"loadout {name!r} is being saved concurrently; try again",
                        code="loadout-save-race",
                    ) from None
                continue
            if saved.created:
                self._svc.audit.record(
                    who.actor,
                    "loadout.save",
                    "loadout",
                    name,
                    detail={"version": saved.version.version, "digest": digest},
                )
            return saved
        raise AssertionError("unreachable")

    async def _record(
        self,
        who: Principal,
        name: str,
        document: dict[str, Any],
        digest: str,
        loadout: Loadout,
        parent_name: str | None,
        parent: Resolved | None,
        shared: bool,
    ) -> Saved:
        async with self._svc.db.session() as s:
            head = await s.get(m.Loadout, name)
            if head is None:
                head = m.Loadout(
                    name=name,
                    source="api",
                    owner=SYSTEM if shared else who.subject,
                    shared=shared,
                    active_version=1,
                )
                s.add(head)
                await s.flush()
                number = 1
            else:
                if not _visible(who, head):
                    raise ConflictError(
                        f"loadout name {name!r} is taken", code="loadout-name-taken"
                    )
                _require_change(who, head)
                same = await s.scalar(
                    select(m.LoadoutVersion).where(
                        m.LoadoutVersion.name == name, m.LoadoutVersion.digest == digest
                    )
                )
                if same is not None:
                    return Saved(head, same, created=False)
                last = await s.scalar(
                    select(func.max(m.LoadoutVersion.version)).where(m.LoadoutVersion.name == name)
                )
                number = (last or 0) + 1
            row = m.LoadoutVersion(
                name=name,
                version=number,
                digest=digest,
                document=document,
                resolved=loadout.model_dump(mode="json"),
                extends_name=parent_name,
                extends_version=parent.version if parent else None,
                created_by=who.subject,
            )
            s.add(row)
            await s.flush()
            return Saved(head, row, created=True)

    # ---- activate --------------------------------------------------------------------------------
    async def activate(self, who: Principal, name: str, version: int, expected: int) -> m.Loadout:
        """Make `version` the active one, if the active one is still `expected` (else
        `ConflictError` with the active version now). Instances made before keep theirs."""
        head = await self.head(who, name)
        _require_change(who, head)
        async with self._svc.db.session() as s:
            if await s.get(m.LoadoutVersion, (name, version)) is None:
                raise InvalidInput(
                    "version",
                    f"loadout {name!r} has no version {version}",
                    summary="no such version",
                )
            moved = await s.execute(
                update(m.Loadout)
                .where(m.Loadout.name == name, m.Loadout.active_version == expected)
                .values(active_version=version, updated_at=dt.datetime.now(dt.UTC))
            )
            if getattr(moved, "rowcount", 0) != 1:
                current = await s.scalar(
                    select(m.Loadout.active_version).where(m.Loadout.name == name)
                )
                raise ConflictError(
                    f"the active version of loadout {name!r} is {current}, not {expected}",
                    code="loadout-version-moved",
                    extra={"active_version": current},
                )
        self._svc.audit.record(
            who.actor, "loadout.activate", "loadout", name, detail={"from": expected, "to": version}
        )
        return await self.head(who, name)

    # ---- what instances and pools are made with ------------------------------------------------
    async def resolve(
        self,
        who: Principal,
        name: str,
        inline: Mapping[str, object] | None = None,
        *,
        version: int | None = None,
    ) -> Resolved:
        """The loadout an instance or pool is made with: `inline` (a loadout as its YAML would
        be; its `extends` is the parent's active version; not recorded) or `name` at `version`
        (default: the active one). A problem is `InvalidInput` of `loadout` (or
        `loadout_version`, `loadout_spec`)."""
        if inline is not None:
            return await self._inline(who, inline)
        async with self._svc.db.session() as s:
            head = await s.get(m.Loadout, name)
            if head is None or not _visible(who, head):
                known = ", ".join(h.name for h, _ in await self.heads(who))
                raise InvalidInput("loadout", f"unknown loadout {name!r} (known: {known})")
            number = head.active_version if version is None else version
            row = await s.get(m.LoadoutVersion, (name, number))
        if row is None:
            raise InvalidInput("loadout_version", f"loadout {name!r} has no version {number}")
        return Resolved(Loadout.model_validate(row.resolved), row.version, row.digest)

    async def _inline(self, who: Principal, inline: Mapping[str, object]) -> Resolved:
        data = dict(inline)
        name = data.get("name")
        if not isinstance(name, str):
            raise InvalidInput("loadout_spec.name", "must be a loadout name")
        parent: Resolved | None = None
        parent_name = data.get("extends")
        if parent_name is not None:
            if not isinstance(parent_name, str):
                raise InvalidInput("loadout_spec.extends", "must be a loadout name")
            try:
                parent = await self.resolve(who, parent_name)
            except InvalidInput as exc:
                raise InvalidInput("loadout_spec.extends", exc.detail) from None
        try:
            return Resolved(extend(parent.loadout if parent else None, data, name))
        except LoadoutError as exc:
            field = f"loadout_spec.{exc.field}" if exc.field else "loadout_spec"
            raise InvalidInput(field, str(exc).split(": ", 1)[-1]) from None
