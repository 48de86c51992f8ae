"""Whether the fleet can be used now, and who may see and change an instance."""

from __future__ import annotations

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.errors import FleetUnavailable, ForbiddenError, NotFoundError
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
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


def require_owner_or_admin(who: Principal, row: m.Instance) -> None:
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
