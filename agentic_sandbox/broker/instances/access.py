"""Whether the fleet can be used now, and who may see and change an instance."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.errors import FleetUnavailable, ForbiddenError, NotFoundError
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.store.rowcache import RowCache
from agentic_sandbox.fleet import Fleet

HOST_AGENT = "host-agent"  # an instance that is an agent on the host: a record, no VM


class FleetGate:
    """The fleet, once it may be used: disabled (no libvirt URI) and not yet connected are
    `FleetUnavailable`. The component opens the gate when the fleet has connected."""

    def __init__(self, fleet: Fleet, *, enabled: bool) -> None:
        self._fleet = fleet
        self.enabled = enabled
        self.opened = False

    def require(self) -> Fleet:
        if not self.enabled:
            raise FleetUnavailable(
                "the fleet is disabled (SANDBOX_LIBVIRT_URI is empty)", retry_after=60
            )
        if not self.opened:
            raise FleetUnavailable("the fleet is still connecting to libvirt")
        return self._fleet


async def visible_instance(db: Database, who: Principal, instance_id: str) -> m.Instance:
    """The live instance `instance_id` if the caller may see it, else `NotFoundError`."""
    async with db.session() as s:
        row = await s.get(m.Instance, instance_id)
    if row is None or row.deleted_at is not None or not who.can_see(row.owner):
        raise NotFoundError("instance", instance_id)
    return row


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the routes across the agent link (exec, files, ports, egress) read of a live
    instance: a read-only copy, which may come from memory (`store/rowcache.py`)."""

    id: str
    owner: str
    incarnation: str
    loadout: str | None
    network_policy: str
    _spec: str  # JSON: every reader gets its own copy

    @property
    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self._spec)
        return out


def _views(db: Database) -> RowCache[InstanceView]:
    cache: RowCache[InstanceView] | None = db.row_caches.get(m.Instance.__tablename__)
    if cache is None:

        async def load(instance_id: str) -> InstanceView | None:
            async with db.session() as s:
                row = await s.get(m.Instance, instance_id)
            if row is None or row.deleted_at is not None:
                return None
            return InstanceView(
                id=row.id,
                owner=row.owner,
                incarnation=row.incarnation,
                loadout=row.loadout,
                network_policy=row.network_policy,
                _spec=json.dumps(row.spec or {}),
            )

        cache = db.row_caches[m.Instance.__tablename__] = RowCache(
            db, m.Instance.__tablename__, load
        )
    return cache


async def instance_view(
    db: Database, who: Principal, instance_id: str, *, change: bool
) -> InstanceView:
    """The live instance as `visible_instance` (or, with `change`, `changeable_instance`)
    finds it, with the same errors, as a read-only view."""
    view = await _views(db).get(instance_id)
    if view is None or not who.can_see(view.owner):
        raise NotFoundError("instance", instance_id)
    if change:
        require_owner_or_admin(who, view)
    return view


def require_owner_or_admin(who: Principal, row: m.Instance | InstanceView) -> None:
    if not (who.is_admin or row.owner == who.subject):
        raise ForbiddenError("only the owner or an admin may change this instance")


async def changeable_instance(db: Database, who: Principal, instance_id: str) -> m.Instance:
    """The instance if the caller may change it: unseen is `NotFoundError`, seen but not
    owned (and not an admin) is `ForbiddenError`."""
    row = await visible_instance(db, who, instance_id)
    require_owner_or_admin(who, row)
    return row


def instance_kind(row: m.Instance) -> str:
    return str((row.spec or {}).get("kind") or "vm")


def is_host_agent(row: m.Instance) -> bool:
    return (row.spec or {}).get("kind") == HOST_AGENT
