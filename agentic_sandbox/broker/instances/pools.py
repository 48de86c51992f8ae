"""Warm pools: per image + loadout version + network, N restored-and-paused VMs ready to hand out.

Preparing a pool boots a *golden* instance once (cold, from the image, with the loadout), waits
until cloud-init is done, saves its memory state and deletes it. The golden never enrolls: its
seed carries no token, so its agent waits for a seed that names a real instance. The fleet then
keeps `size` clones of that state restored and paused; a create `from_pool` takes one, gives it
its own seed (its identity and a one-time enrollment token), resumes it, and the agent enrolls
as the new instance within a second or two.
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
from agentic_sandbox.broker.instances.errors import InvalidInput, NotFoundError
from agentic_sandbox.broker.instances.images import ImageCatalog
from agentic_sandbox.broker.instances.loadouts import Loadouts, Resolved
from agentic_sandbox.broker.instances.provisioning import Provisioning
from agentic_sandbox.broker.operations import OperationFailed, OperationRunner, Progress
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import EgressPolicy, Fleet, FleetError
from agentic_sandbox.images import BuiltImage
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
        state_id = f"{key}-{image.name[-12:]}"
        if state_id not in {s.state_id for s in await self._fleet.list_states()}:
            await self._capture_golden(progress, key, state_id, image, loadout, network)
        progress.stage("filling")
        await self._fleet.configure_pool(
            key, state_id, size, egress=network, agent_port=self._agent_port
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
        async with self._svc.db.session() as s:
            row = await s.get(m.KeyValue, KV_PREFIX + key)
            if row is None:
                s.add(m.KeyValue(key=KV_PREFIX + key, value=record.model_dump()))
            else:
                row.value = record.model_dump()
        return record

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
