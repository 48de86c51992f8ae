"""Warm pools: per image + loadout version + network, N restored-and-paused VMs ready to hand out.

Preparing a pool boots a *golden* instance once (cold, from the image, with the loadout), waits
until cloud-init is done, saves its memory state and deletes it. The golden never enrolls: its
seed carries no token, so its agent waits for a seed that names a real instance. The fleet then
keeps `size` clones of that state restored and paused; a create `from_pool` takes one, gives it
its own seed (its identity and a one-time enrollment token), resumes it, and the agent enrolls
as the new instance within a second or two.

Draining a host moves the pools whose state is there (`move_off`): one `pool-move` operation
each captures a new golden state on another host (placement skips the drained one), gives the
pool that state — the fleet makes the new members first and retires an old one with each — and
deletes the old state. When no other host can take a pool, the drain answer says so and its
members stay.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from dataclasses import dataclass

from pydantic import BaseModel
from sqlalchemy import select

from agentic_sandbox.broker.auth.principal import Principal
from agentic_sandbox.broker.instances.access import FleetGate
from agentic_sandbox.broker.instances.enroller import LinkEnroller
from agentic_sandbox.broker.instances.errors import InstanceError, InvalidInput, NotFoundError
from agentic_sandbox.broker.instances.images import ImageCatalog
from agentic_sandbox.broker.instances.loadouts import Loadouts, Resolved
from agentic_sandbox.broker.instances.provisioning import Provisioning
from agentic_sandbox.broker.operations import OperationFailed, OperationRunner, Progress
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import EgressPolicy, Fleet, FleetError, Standby
from agentic_sandbox.images import BuiltImage
from agentic_sandbox.proto.seed_record import NO_SPARE_KEY, SPARE_KEY_READY
from agentic_sandbox.provision import Loadout, ProvisionError, ProvisionRequest, network_refusal

log = logging.getLogger(__name__)

KV_PREFIX = "pool:"
DONE_MARKER = b"agentic-sandbox: stage cloud-init-done"
PREPARE_STAGES = ("golden", "settling", "saving", "filling")


def pool_key(image: str, loadout: str, network: str, version: int | None) -> str:
    """A fleet-safe name for (image, loadout at `version`, network): a pool is of one exact
    loadout version, so activating another version never changes what a pool hands out."""
    ident = f"{image}\0{loadout}@{version}\0{network}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
    return f"pool-{digest}"


class PoolRecord(BaseModel):
    """A prepared pool as the server keeps it (a `kv` row `pool:<key>`)."""

    key: str
    image: str
    loadout: str
    loadout_version: int | None = None  # None: a pool prepared before loadouts had versions
    network: str
    size: int
    state_id: str = ""


@dataclass(frozen=True)
class PoolMove:
    """What a drain does with one pool on the drained host."""

    key: str
    state: str  # moving | stuck
    operation_id: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class PoolView:
    record: PoolRecord
    ready: int  # paused members ready to hand out
    last_error: str


class WarmPools:
    def __init__(
        self,
        svc: Services,
        fleet: Fleet,
        gate: FleetGate,
        ops: OperationRunner,
        *,
        provisioning: Provisioning,
        images: ImageCatalog,
        loadouts: Loadouts,
    ) -> None:
        self._svc = svc
        self._fleet = fleet
        self._gate = gate
        self._ops = ops
        self._provisioning = provisioning
        self._images = images
        self._loadouts = loadouts
        self._moving: dict[str, str] = {}  # pool key -> the id of its pool-move operation

    @property
    def _agent_port(self) -> int:
        return self._svc.settings.guest_link_address[1]

    async def saved(self) -> list[PoolRecord]:
        async with self._svc.db.session() as s:
            rows = (
                await s.scalars(select(m.KeyValue).where(m.KeyValue.key.startswith(KV_PREFIX)))
            ).all()
        return [PoolRecord.model_validate(r.value) for r in rows]

    async def exists(self, key: str) -> bool:
        """Whether the fleet keeps a pool under `key` now."""
        return key in {p.key for p in await self._gate.require().pool_status()}

    async def restore(self) -> None:
        """At start: configure the pools prepared before (their members are re-adopted)."""
        states = {s.state_id for s in await self._fleet.list_states()}
        for pool in await self.saved():
            if pool.state_id not in states:
                log.warning("warm pool %s lost its saved state; prepare it again", pool.key)
                continue
            try:
                await self._fleet.configure_pool(
                    pool.key,
                    pool.state_id,
                    pool.size,
                    egress=EgressPolicy(pool.network),
                    agent_port=self._agent_port,
                    standby=self._standby(),
                )
            except FleetError as exc:
                log.error("warm pool %s: %s", pool.key, exc)

    async def views(self) -> list[PoolView]:
        """Every prepared pool with how many members it has ready."""
        status = {p.key: p for p in await self._gate.require().pool_status()}
        out = []
        for pool in await self.saved():
            st = status.get(pool.key)
            out.append(
                PoolView(
                    record=pool,
                    ready=st.ready if st else 0,
                    last_error=st.last_error if st else "not configured",
                )
            )
        return out

    async def prepare(
        self,
        who: Principal,
        *,
        image: str | None,
        loadout: str,
        loadout_version: int | None = None,
        network: str | None,
        size: int,
    ) -> m.Operation:
        """Prepare (or resize) the pool of image + loadout version (default: the active one)
        + network as an operation."""
        self._gate.require()
        built = self._images.resolve(image)
        resolved = await self._loadouts.resolve(who, loadout, version=loadout_version)
        egress = EgressPolicy(network or resolved.loadout.network)
        refusal = network_refusal(resolved.loadout, built, egress)
        if refusal is not None:  # every member's first boot would fail
            raise InvalidInput("network", refusal, summary="this first boot needs network 'nat'")

        async def body(progress: Progress) -> dict[str, object]:
            record = await self._prepare(progress, built, resolved, egress, size)
            return record.model_dump()

        op = await self._ops.submit(
            kind="pool-prepare",
            subject_type="pool",
            subject_id=pool_key(built.name, resolved.loadout.name, egress.value, resolved.version),
            owner=who.subject,
            actor=who.actor,
            body=body,
            planned=PREPARE_STAGES,
        )
        self._svc.audit.record(
            who.actor, "pool.prepare", "pool", op.subject_id, detail={"size": size}
        )
        return op

    async def _prepare(
        self,
        progress: Progress,
        image: BuiltImage,
        resolved: Resolved,
        network: EgressPolicy,
        size: int,
    ) -> PoolRecord:
        loadout = resolved.loadout
        key = pool_key(image.name, loadout.name, network.value, resolved.version)
        states = {s.state_id for s in await self._fleet.list_states()}
        kept = next((p.state_id for p in await self.saved() if p.key == key), "")
        state_id = kept if kept in states else f"{key}-{image.name[-12:]}"  # a moved pool's own
        if state_id not in states:
            await self._capture_golden(progress, key, state_id, image, loadout, network)
        progress.stage("filling")
        await self._fleet.configure_pool(
            key,
            state_id,
            size,
            egress=network,
            agent_port=self._agent_port,
            standby=self._standby(),
        )
        record = PoolRecord(
            key=key,
            image=image.name,
            loadout=loadout.name,
            loadout_version=resolved.version,
            network=network.value,
            size=size,
            state_id=state_id,
        )
        await self._keep(record)
        return record

    async def _keep(self, record: PoolRecord) -> None:
        async with self._svc.db.session() as s:
            row = await s.get(m.KeyValue, KV_PREFIX + record.key)
            if row is None:
                s.add(m.KeyValue(key=KV_PREFIX + record.key, value=record.model_dump()))
            else:
                row.value = record.model_dump()

    # ---- moving off a drained host -------------------------------------------------------------
    async def move_off(self, who: Principal, host: str) -> list[PoolMove]:
        """Start moving every pool whose saved state is on ``host`` to another host (one
        `pool-move` operation each; a pool already moving keeps its operation). A pool that
        no other host can take is `stuck`, with the reason, and keeps its members."""
        fleet = self._gate.require()
        states = {s.state_id: s for s in await fleet.list_states()}
        others = [
            h.spec.name
            for h in await fleet.list_hosts()
            if h.spec.name != host and h.reachable and not h.draining
        ]
        out: list[PoolMove] = []
        for pool in await self.saved():
            st = states.get(pool.state_id)
            if st is None or st.host != host:
                continue
            if pool.key in self._moving:
                out.append(PoolMove(pool.key, "moving", self._moving[pool.key]))
                continue
            if not others:
                reason = (
                    f"no other host can take it (every other host is unreachable or "
                    f"draining); its {pool.size} member(s) stay on {host}"
                )
                out.append(PoolMove(pool.key, "stuck", None, reason))
                continue
            op = await self._submit_move(who, pool, host)
            out.append(PoolMove(pool.key, "moving", op.id))
        return out

    async def _submit_move(self, who: Principal, pool: PoolRecord, host: str) -> m.Operation:
        async def body(progress: Progress) -> dict[str, object]:
            try:
                return await self._move(who, progress, pool, host)
            finally:
                self._moving.pop(pool.key, None)

        op = await self._ops.submit(
            kind="pool-move",
            subject_type="pool",
            subject_id=pool.key,
            owner=who.subject,
            actor=who.actor,
            body=body,
            planned=PREPARE_STAGES,
        )
        self._moving[pool.key] = op.id
        self._svc.audit.record(who.actor, "pool.move", "pool", pool.key, detail={"from": host})
        return op

    async def _move(
        self, who: Principal, progress: Progress, pool: PoolRecord, host: str
    ) -> dict[str, object]:
        fleet = self._gate.require()
        try:
            image = self._images.resolve(pool.image)
            resolved = await self._loadouts.resolve(who, pool.loadout, version=pool.loadout_version)
        except InstanceError as exc:  # the image or loadout version is gone: nothing to rebuild
            raise OperationFailed("golden", f"pool {pool.key} cannot be rebuilt: {exc}") from None
        network = EgressPolicy(pool.network)
        state_id = f"{pool.key}-{secrets.token_hex(4)}"
        await self._capture_golden(progress, pool.key, state_id, image, resolved.loadout, network)
        placed = next((s.host for s in await fleet.list_states() if s.state_id == state_id), "")
        progress.stage("filling")
        try:
            status = await fleet.configure_pool(
                pool.key,
                state_id,
                pool.size,
                egress=network,
                agent_port=self._agent_port,
                standby=self._standby(),
                wait=True,
            )
        except FleetError as exc:
            raise OperationFailed("filling", str(exc)) from None
        await self._keep(pool.model_copy(update={"state_id": state_id}))
        if status.retiring:
            raise OperationFailed(
                "filling",
                f"{status.ready - status.retiring} of {pool.size} new member(s) on {placed}: "
                f"{status.last_error or 'no room'}; {status.retiring} stay on {host}",
            )
        try:
            await fleet.delete_state(pool.state_id)
        except FleetError as exc:  # its frozen disk stays while clones use it anyway
            log.warning("pool %s: deleting its old state %s: %s", pool.key, pool.state_id, exc)
        return {
            "key": pool.key,
            "from": host,
            "to": placed,
            "state_id": state_id,
            "ready": status.ready,
        }

    async def _capture_golden(
        self,
        progress: Progress,
        key: str,
        state_id: str,
        image: BuiltImage,
        loadout: Loadout,
        network: EgressPolicy,
    ) -> None:
        """Boot the golden VM, wait for its cloud-init, save its memory as `state_id` and
        delete it, whatever happens."""
        # a name of this preparation's own: servers sharing a libvirtd prepare the same pool keys
        golden = f"golden-{key.removeprefix('pool-')}-{secrets.token_hex(3)}"
        progress.stage("golden")
        ssh_key = self._provisioning.ssh_public_key
        req = ProvisionRequest(
            instance_id=golden,
            owner="system",
            loadout=loadout,
            source="image",
            image=image,
            network=network,
            ssh_keys=(ssh_key,) if ssh_key else (),
            wait_ready=False,
        )
        try:
            await self._provisioning.provisioner.provision(req, None)
            progress.stage("settling")
            limit = self._svc.settings.provision_ready_timeout_seconds
            try:
                await self._wait_marker(golden, limit)
            except TimeoutError:
                tail = (await self._fleet.read_serial_log(golden))[-4000:]
                raise OperationFailed(
                    "settling",
                    f"the golden VM's cloud-init did not finish within {limit:.0f}s",
                    {"diagnostics": "serial console (tail):\n" + tail.decode("utf-8", "replace")},
                ) from None
            await asyncio.sleep(2.0)  # let the agent start and settle into waiting
            progress.stage("saving")
            await self._fleet.capture_state(golden, state_id)
        except (ProvisionError, FleetError, TimeoutError) as exc:
            stage = getattr(exc, "stage", None) or "golden"
            raise OperationFailed(str(stage), str(getattr(exc, "cause", exc))) from None
        finally:
            try:
                await self._fleet.delete(golden)
            except FleetError:
                log.exception("deleting golden %s failed", golden)

    def _standby(self) -> Standby:
        """Each new member gets a standby seed of its own and is paused once its agent has
        made the key of the instance it will become (`proto/seed_record.py`)."""
        provisioner = self._provisioning.provisioner
        enroller = self._provisioning.enroller
        ca_pem = enroller.ca_pem if isinstance(enroller, LinkEnroller) else ""

        async def seed(member_id: str) -> str:
            return str(await asyncio.to_thread(provisioner.standby_seed, member_id, ca_pem))

        return Standby(seed=seed, ready=(SPARE_KEY_READY.encode(), NO_SPARE_KEY.encode()))

    async def _wait_marker(self, instance_id: str, limit: float) -> None:
        async with asyncio.timeout(limit):
            while True:
                log_bytes = await self._fleet.read_serial_log(instance_id)
                if DONE_MARKER in log_bytes:
                    return
                await asyncio.sleep(1.0)

    async def remove(self, who: Principal, key: str) -> None:
        """Drain and remove a pool; an unknown key is `NotFoundError`."""
        fleet = self._gate.require()
        pool = next((p for p in await self.saved() if p.key == key), None)
        if pool is None:
            raise NotFoundError("pool", key)
        # Its members go; instances taken from it keep running on the golden state's frozen disk,
        # which the fleet removes with the last of them (the memory image goes now). A failure
        # keeps the pool's row, so the removal can be retried.
        await fleet.remove_pool(key)
        await fleet.delete_state(pool.state_id)
        async with self._svc.db.session() as s:
            row = await s.get(m.KeyValue, KV_PREFIX + key)
            if row is not None:
                await s.delete(row)
        self._svc.audit.record(who.actor, "pool.remove", "pool", key)
