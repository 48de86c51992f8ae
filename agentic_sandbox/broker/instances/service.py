"""Instances: create (a provision operation), list, look at, act on, clone and delete.

Every path that ends an instance goes through `end_instance`: the row is marked deleted and
the incarnation ends (every component's hook runs), so nothing bound to it survives. A delete
goes through the fleet first — the snapshots' saved states, then the VM — and a failure there
keeps everything, so it can be retried.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from sqlalchemy import func, select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.access import (
    FleetGate,
    changeable_instance,
    is_host_agent,
    visible_instance,
)
from agentic_sandbox.broker.instances.errors import (
    ConflictError,
    InstanceError,
    InvalidInput,
    QuotaExceeded,
)
from agentic_sandbox.broker.instances.images import ImageCatalog
from agentic_sandbox.broker.instances.loadouts import Loadouts, Resolved
from agentic_sandbox.broker.instances.pools import WarmPools, pool_key
from agentic_sandbox.broker.instances.provisioning import Provisioning
from agentic_sandbox.broker.instances.snapshots import SnapshotService, state_id_of
from agentic_sandbox.broker.observability.logs import redactor
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import EgressPolicy, Fleet, Instance
from agentic_sandbox.images import BuiltImage
from agentic_sandbox.provision import Loadout, ProvisionRequest, network_refusal
from agentic_sandbox.provision.egress_rules import EgressConfig

Source = Literal["image", "state", "pool"]


class Action(StrEnum):
    """What can be done to an instance's VM."""

    START = "start"
    STOP = "stop"
    RESTART = "restart"
    FORCE_OFF = "force-off"
    SUSPEND = "suspend"
    RESUME = "resume"


@dataclass(frozen=True)
class NewInstance:
    """What a create asks for. Exactly one source: `from_snapshot` (INSTANCE/SNAPSHOT, a
    memory snapshot restored under the new identity), the warm pool, or else the image.

    `from_pool`: True takes from the matching pool (an error when there is none), False boots
    from the image, None (the default) takes from the matching pool when there is one and
    the create asks for nothing its members lack (see `_pool_may_serve`), else boots."""

    id: str
    image: str | None = None  # an image, or a recipe whose cached build is used; default recipe
    loadout: str = "minimal"
    loadout_version: int | None = None  # a version of `loadout`; default: its active one
    loadout_spec: dict[str, object] | None = None  # an inline loadout instead of `loadout`
    from_snapshot: str | None = None
    from_pool: bool | None = None
    cpus: int | None = None
    memory_mib: int | None = None
    disk_gib: int | None = None
    network: Literal["isolated", "allowlist", "nat"] | None = None
    egress: EgressConfig | None = None  # the allowlist; default: the loadout's
    ssh_keys: tuple[str, ...] = ()
    host: str | None = None
    host_labels: dict[str, str] = field(default_factory=dict)
    wait_ready: bool = True  # the operation ends when the agent enrolls
    start: bool = True  # false: define only
    ready_timeout_seconds: float | None = None  # default: the server's


@dataclass(frozen=True)
class InstanceFilter:
    state: str | None = None
    host: str | None = None
    owner: str | None = None  # admins only: others see their own
    limit: int = 500


@dataclass(frozen=True)
class ConsoleTail:
    instance_id: str
    size: int  # of the whole log
    text: str  # the tail, decoded, secrets masked


@dataclass(frozen=True)
class _Plan:
    """Where a create's VM comes from."""

    source: Source
    image: BuiltImage | None = None
    state_id: str | None = None
    pool_key: str | None = None


def _pool_may_serve(new: NewInstance) -> bool:
    """Whether a pool member is what this create asks for: a member runs its loadout's stored
    version with its resources, on the host its pool is on, started."""
    return (
        new.loadout_spec is None
        and new.cpus is None
        and new.memory_mib is None
        and new.disk_gib is None
        and new.host is None
        and not new.host_labels
        and new.start
    )


class InstanceService:
    def __init__(
        self,
        svc: Services,
        gate: FleetGate,
        *,
        images: ImageCatalog,
        loadouts: Loadouts,
        pools: WarmPools,
        snapshots: SnapshotService,
        provisioning: Provisioning,
    ) -> None:
        self._svc = svc
        self._gate = gate
        self._images = images
        self._loadouts = loadouts
        self._pools = pools
        self._snapshots = snapshots
        self._provisioning = provisioning

    # ---- create ---------------------------------------------------------------------------------
    async def create(self, who: Principal, new: NewInstance) -> m.Operation:
        """Record the instance (`provisioning`, a new incarnation) and start its provision.

        Checked before anything is recorded, in this order: the fleet is up, the loadout and
        the source exist, the id is free (a deleted instance's row is replaced: its id is a
        reusable name), the owner is under the instance quota."""
        self._gate.require()
        resolved = await self._loadouts.resolve(
            who, new.loadout, new.loadout_spec, version=new.loadout_version
        )
        loadout = resolved.loadout
        plan = await self._plan(who, new, resolved)
        settings = self._svc.settings
        async with self._svc.db.session() as s:
            existing = await s.get(m.Instance, new.id)
            if existing is not None and existing.deleted_at is None:
                raise ConflictError(f"instance {new.id!r} already exists", code="instance-exists")
            count = await s.scalar(
                select(func.count())
                .select_from(m.Instance)
                .where(m.Instance.owner == who.subject, m.Instance.deleted_at.is_(None))
            )
            if (count or 0) >= settings.max_instances_per_owner:
                limit = settings.max_instances_per_owner
                raise QuotaExceeded(
                    f"{who.subject} has {count} instances (limit {limit})", retry_after=60
                )
            if existing is not None:
                await s.delete(existing)
                await s.flush()
            incarnation = m.new_incarnation()
            s.add(
                m.Instance(
                    id=new.id,
                    incarnation=incarnation,
                    owner=who.subject,
                    state="provisioning",
                    image=plan.image.name if plan.image else None,
                    loadout=loadout.name,
                    loadout_version=resolved.version,
                    loadout_digest=resolved.digest,
                    vcpus=new.cpus or loadout.resources.cpus,
                    memory_mib=new.memory_mib or loadout.resources.memory_mib,
                    disk_gib=new.disk_gib or loadout.resources.disk_gib,
                    network_policy=new.network or loadout.network,
                    # exec budgets are the loadout's as it was at create (inline ones included)
                    spec={
                        "budgets": loadout.budgets.model_dump(mode="json"),
                        # the allowlist the egress proxy enforces (the admin API replaces it)
                        "egress": (new.egress or loadout.egress).model_dump(mode="json"),
                    },
                )
            )
        self._svc.audit.transition(
            who.actor, "instance", new.id, None, "provisioning", cause=plan.source
        )
        self._svc.events.publish(
            "instance.provisioning",
            actor=who.actor,
            owner=who.subject,
            instance_id=new.id,
            data={
                "source": plan.source,
                "loadout": loadout.name,
                "loadout_version": resolved.version,
            },
        )
        req = ProvisionRequest(
            instance_id=new.id,
            incarnation=incarnation,
            owner=who.subject,
            loadout=loadout,
            source=plan.source,
            image=plan.image,
            state_id=plan.state_id,
            pool_key=plan.pool_key,
            vcpus=new.cpus,
            memory_mib=new.memory_mib,
            disk_gib=new.disk_gib,
            network=EgressPolicy(new.network) if new.network else None,
            ssh_keys=new.ssh_keys,
            host=new.host,
            host_labels=dict(new.host_labels),
            ready_timeout=new.ready_timeout_seconds or settings.provision_ready_timeout_seconds,
            ready_limit=None
            if new.ready_timeout_seconds
            else settings.provision_ready_limit_seconds,
            wait_ready=new.wait_ready and new.start,
            start=new.start,
        )
        return await self._provisioning.submit(req, actor=who.actor, source_label=plan.source)

    async def _plan(self, who: Principal, new: NewInstance, resolved: Resolved) -> _Plan:
        loadout = resolved.loadout
        if new.from_snapshot:
            src_id, snap = new.from_snapshot.split("/", 1)
            return _Plan("state", state_id=await self._snapshots.memory_state(who, src_id, snap))
        if new.from_pool is None and _pool_may_serve(new):
            image = self._images.resolve(new.image)
            key = pool_key(
                image.name, loadout.name, new.network or loadout.network, resolved.version
            )
            with contextlib.suppress(InstanceError):  # no fleet yet: the cold path says so
                if await self._pools.exists(key):
                    return _Plan("pool", pool_key=key)
        elif new.from_pool:
            image = self._images.resolve(new.image)
            network = new.network or loadout.network
            key = pool_key(image.name, loadout.name, network, resolved.version)
            if not await self._pools.exists(key):
                raise InvalidInput(
                    "from_pool",
                    f"no warm pool for image {image.name}, loadout {loadout.name} version "
                    f"{resolved.version}, network {network} (POST /api/v2/admin/pools first)",
                    summary="no such pool",
                )
            return _Plan("pool", pool_key=key)
        image = self._images.resolve(new.image)
        _refuse_network(loadout, image, new.network or loadout.network)
        return _Plan("image", image=image)

    async def clone(
        self,
        who: Principal,
        source_id: str,
        *,
        new_id: str,
        snapshot: str,
        ssh_keys: tuple[str, ...] = (),
        wait_ready: bool = True,
    ) -> m.Operation:
        """A new instance from one of `source_id`'s memory snapshots, with its loadout."""
        source = await visible_instance(self._svc.db, who, source_id)
        new = NewInstance(
            id=new_id,
            from_snapshot=f"{source_id}/{snapshot}",
            ssh_keys=ssh_keys,
            wait_ready=wait_ready,
            loadout=source.loadout or "minimal",
            loadout_version=source.loadout_version,
        )
        return await self.create(who, new)

    # ---- look -----------------------------------------------------------------------------------
    async def list_instances(self, who: Principal, where: InstanceFilter) -> list[m.Instance]:
        """Live instances by id: the caller's own, or anyone's (filtered by owner) for admins."""
        stmt = select(m.Instance).where(m.Instance.deleted_at.is_(None)).order_by(m.Instance.id)
        if not who.is_admin:
            stmt = stmt.where(m.Instance.owner == who.subject)
        elif where.owner:
            stmt = stmt.where(m.Instance.owner == where.owner)
        if where.state:
            stmt = stmt.where(m.Instance.state == where.state)
        if where.host:
            stmt = stmt.where(m.Instance.host == where.host)
        async with self._svc.db.session() as s:
            return list((await s.scalars(stmt.limit(where.limit))).all())

    async def get(self, who: Principal, instance_id: str) -> m.Instance:
        return await visible_instance(self._svc.db, who, instance_id)

    async def console(self, who: Principal, instance_id: str, *, tail: int) -> ConsoleTail:
        """The last `tail` bytes of the serial console, with the vault's secrets masked."""
        fleet = self._gate.require()
        row = await visible_instance(self._svc.db, who, instance_id)
        data = await fleet.read_serial_log(row.id)
        text = data[-tail:].decode("utf-8", "replace")
        return ConsoleTail(instance_id=row.id, size=len(data), text=redactor.text(text))

    # ---- act ------------------------------------------------------------------------------------
    async def act(
        self, who: Principal, instance_id: str, action: Action, *, grace_s: float | None = None
    ) -> m.Instance:
        """Do `action` to the instance's VM (`grace_s`: how long `stop` waits before forcing
        it off); the row, with the state the VM is in now."""
        row = await changeable_instance(self._svc.db, who, instance_id)
        if is_host_agent(row):
            raise ConflictError(
                f"instance {row.id} is an agent on the host: it has no VM to {action}"
            )
        fleet = self._gate.require()
        if row.state == "provisioning":
            raise ConflictError(f"instance {row.id} is still being provisioned")
        await _run(fleet, action, row.id, grace_s)
        inst = await fleet.get(row.id)
        self._svc.audit.record(who.actor, f"instance.{action}", "instance", row.id)
        async with self._svc.db.session() as s:
            fresh = await s.get(m.Instance, row.id)
            assert fresh is not None
            fresh.state = inst.state.value
            fresh.state_reason = inst.state_reason
        return fresh

    # ---- end ------------------------------------------------------------------------------------
    async def delete(self, who: Principal, instance_id: str) -> None:
        """Delete an instance: its snapshots' saved states, its VM (domain, disks, seed, ports)
        and its record; then its incarnation ends. A host agent has no VM: only its record and
        what is bound to it go."""
        row = await changeable_instance(self._svc.db, who, instance_id)
        if not is_host_agent(row):
            fleet = self._gate.require()
            snaps = await self._snapshots.rows(row.id)
            # Its snapshots' memory states first: their images go now, their frozen disks with
            # the last clone backed by them (the fleet keeps that count). A failure keeps
            # everything.
            for snap in snaps:
                state_id = state_id_of(snap)
                if state_id:
                    await fleet.delete_state(state_id)
            await fleet.delete(row.id)
            await self._snapshots.forget(snaps)
        await self.end_instance(row.id, actor=who.actor, reason=f"deleted by {who.actor}")

    async def end_instance(self, instance_id: str, *, actor: str, reason: str) -> None:
        """Mark the instance deleted and end its incarnation: nothing bound to it survives (its
        agent link, certificates, tokens, A2A keys, secret bindings, shares, sessions, tasks)."""
        svc = self._svc
        async with svc.db.session() as s:
            fresh = await s.get(m.Instance, instance_id)
            if fresh is None or fresh.deleted_at is not None:
                return
            before, incarnation, owner = fresh.state, fresh.incarnation, fresh.owner
            fresh.state = "deleted"
            fresh.deleted_at = dt.datetime.now(dt.UTC)
        svc.audit.transition(actor, "instance", instance_id, before, "deleted", cause=reason)
        failed = await svc.incarnations.end(instance_id, incarnation, actor=actor, reason=reason)
        svc.events.publish(
            "instance.deleted",
            actor=actor,
            owner=owner,
            instance_id=instance_id,
            data={"incarnation": incarnation, **({"cleanup_failed": failed} if failed else {})},
        )


async def _run(fleet: Fleet, action: Action, instance_id: str, grace_s: float | None) -> Instance:
    match action:
        case Action.START:
            return await fleet.start(instance_id)
        case Action.STOP:
            return await fleet.shutdown(instance_id, grace_s=grace_s)
        case Action.RESTART:
            return await fleet.reboot(instance_id)
        case Action.FORCE_OFF:
            return await fleet.force_off(instance_id)
        case Action.SUSPEND:
            return await fleet.suspend(instance_id)
        case Action.RESUME:
            return await fleet.resume(instance_id)


def _refuse_network(loadout: Loadout, image: BuiltImage | None, network: str) -> None:
    """A 422 naming `network` for a first boot that needs the network it is not given."""
    refusal = network_refusal(loadout, image, EgressPolicy(network))
    if refusal is not None:
        raise InvalidInput("network", refusal, summary="this first boot needs network 'nat'")
