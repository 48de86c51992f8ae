"""Warm pool: per key (image + loadout), N instances restored from a saved state and kept
paused, so creating one is a metadata rewrite, an optional seed swap and a resume.

A new member runs for ``pool_warmup_s`` before it is paused: under TCG a freshly restored guest
spends its first few hundred milliseconds filling QEMU's translation cache, and that should happen
before a hand-off, not after. Refills start ``pool_refill_delay_s`` after a hand-off so they do not
compete with the guest just handed out.

Pool members are ordinary fleet instances with ``record.pool`` set and ids ``pool-<hex>`` (hidden
from ``list_instances`` unless asked). Taking one re-keys it under the caller's instance id (the
libvirt domain keeps its ``sbx-pool-…`` name: libvirt cannot rename a running domain; the fleet
finds domains by the record in their metadata, not by name). Refills run in the background and
stop short of the configured size when the host's free memory (minus a headroom) runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field

import libvirt

from .core import FleetBase
from .errors import Conflict, FleetError, InvalidRequest, NotFound
from .lifecycle import save_record
from .models import (
    CloneSpec,
    EgressPolicy,
    FleetEventKind,
    Instance,
    InstanceState,
    validate_name,
)

log = logging.getLogger(__name__)


@dataclass
class PoolSlot:
    key: str
    state_id: str
    size: int
    egress: EgressPolicy
    agent_port: int
    ready: list[str] = field(default_factory=list)
    refill: asyncio.Task[None] | None = None
    last_error: str = ""


@dataclass(frozen=True)
class PoolStatus:
    key: str
    state_id: str
    size: int
    ready: int
    last_error: str


class WarmPoolOps(FleetBase):
    pools: dict[str, PoolSlot]

    def _pools(self) -> dict[str, PoolSlot]:
        if not hasattr(self, "pools"):
            self.pools = {}
        return self.pools

    async def configure_pool(
        self,
        key: str,
        state_id: str,
        size: int,
        *,
        egress: EgressPolicy = EgressPolicy.ISOLATED,
        agent_port: int = 8120,
        wait: bool = False,
    ) -> PoolStatus:
        """Keep ``size`` paused clones of ``state_id`` ready under ``key``. Members already in
        libvirt (after a restart) are taken back into the pool. ``size=0`` drains it."""
        validate_name(key)
        if size < 0:
            raise InvalidRequest("size must be >= 0")
        if state_id not in self.saved_states:
            raise NotFound(f"no saved state {state_id!r}")
        pools = self._pools()
        slot = pools.get(key)
        if slot is None:
            slot = PoolSlot(key, state_id, size, egress, agent_port)
            pools[key] = slot
        else:
            slot.state_id, slot.size, slot.egress, slot.agent_port = (
                state_id,
                size,
                egress,
                agent_port,
            )
        for e in self.entries.values():
            if (
                e.record.pool == key
                and e.record.instance_id not in slot.ready
                and e.state is InstanceState.PAUSED
            ):
                slot.ready.append(e.record.instance_id)
        while len(slot.ready) > size:
            await self.delete(slot.ready.pop())  # type: ignore[attr-defined]
        self._kick(slot)
        if wait and slot.refill is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(slot.refill)
        return self._status(slot)

    def _status(self, slot: PoolSlot) -> PoolStatus:
        return PoolStatus(slot.key, slot.state_id, slot.size, len(slot.ready), slot.last_error)

    async def pool_status(self) -> list[PoolStatus]:
        return [self._status(s) for s in self._pools().values()]

    def _kick(self, slot: PoolSlot, delay: float = 0.0) -> None:
        if slot.refill is None or slot.refill.done():
            slot.refill = self.spawn(self._refill(slot, delay))

    async def _refill(self, slot: PoolSlot, delay: float = 0.0) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        while len(slot.ready) < slot.size and not self._closed:
            st = self.saved_states.get(slot.state_id)
            if st is None:
                slot.last_error = f"saved state {slot.state_id} is gone"
                return
            h = self.host(st.host)
            try:
                free_mib = await h.run(h.free_memory_mib)
            except FleetError as e:
                slot.last_error = str(e)
                return
            if free_mib - st.memory_mib < self.config.pool_memory_headroom_mib:
                slot.last_error = (
                    f"host {h.name}: {free_mib} MiB free, not refilling below "
                    f"{self.config.pool_memory_headroom_mib} MiB headroom"
                )
                return
            token = secrets.token_hex(5)
            member = f"pool-{token}"
            warmup = self.config.pool_warmup_s
            try:
                await self.clone_from_state(  # type: ignore[attr-defined]
                    slot.state_id,
                    CloneSpec(
                        instance_id=member,
                        egress=slot.egress,
                        agent_port=slot.agent_port,
                        restart_on_crash=False,
                    ),
                    paused=warmup <= 0,
                    pool=slot.key,
                    domain=f"sbx-pool-{token}",
                )
                if warmup > 0:
                    await asyncio.sleep(warmup)
                    await self.suspend(member)  # type: ignore[attr-defined]
            except BaseException as e:
                with contextlib.suppress(FleetError):
                    await asyncio.shield(self.delete(member))  # type: ignore[attr-defined]
                if not isinstance(e, FleetError):
                    raise
                slot.last_error = str(e)
                log.warning("warm pool %s: refill failed: %s", slot.key, e)
                return
            slot.ready.append(member)
            slot.last_error = ""
            self.emit(
                FleetEventKind.POOL_REFILLED,
                host=h.name,
                instance_id=member,
                detail=f"pool {slot.key}: {len(slot.ready)}/{slot.size}",
            )

    async def take_from_pool(self, key: str, spec: CloneSpec) -> Instance | None:
        """Hand a pooled, paused instance to ``spec.instance_id`` and resume it; ``None`` when
        the pool is empty (the caller then uses ``clone_from_state``)."""
        slot = self._pools().get(key)
        if slot is None:
            raise NotFound(f"no warm pool {key!r}")
        if spec.egress != slot.egress or spec.agent_port != slot.agent_port:
            raise InvalidRequest(
                f"pool {key} serves egress={slot.egress.value} agent_port={slot.agent_port}"
            )
        if spec.instance_id in self.entries:
            raise Conflict(f"instance {spec.instance_id!r} already exists")
        while slot.ready:
            member = slot.ready.pop(0)
            e = self.entries.get(member)
            if e is None or e.deleting or e.state is not InstanceState.PAUSED:
                continue
            async with e.lock:
                h = self.host(e.record.host)
                old_id = e.record.instance_id
                record = e.record.model_copy(
                    update={
                        "instance_id": spec.instance_id,
                        "owner": spec.owner,
                        "incarnation": spec.incarnation,
                        "loadout": spec.loadout or e.record.loadout,
                        "pool": None,
                        "restart_on_crash": spec.restart_on_crash,
                    }
                )
                try:
                    dom = await self.lookup_domain(e)

                    # re-key first so events from the resume find the new id
                    self.entries[spec.instance_id] = e
                    del self.entries[old_id]
                    e.record = record
                    # Resume first: the guest runs while libvirt writes its config, and a media
                    # change (the new seed) needs a running guest to release the tray — on a
                    # paused one QEMU waits for the eject until it times out.
                    self.fault("booting")
                    await h.run(dom.resume)
                    if spec.seed:
                        await self._set_seed_locked(e, spec.seed)  # type: ignore[attr-defined]
                    await h.run(save_record, dom, record)
                except (FleetError, libvirt.libvirtError) as err:
                    log.warning("warm pool %s: hand-off of %s failed: %s", key, old_id, err)
                    self.entries.pop(spec.instance_id, None)
                    e.record = e.record.model_copy(update={"instance_id": old_id})
                    self.entries[old_id] = e
                    self.spawn(self.delete(old_id))  # type: ignore[attr-defined]
                    continue
                self.set_state(e, InstanceState.RUNNING, f"taken from warm pool {key}")
            self.emit(
                FleetEventKind.INSTANCE_CREATED,
                host=e.record.host,
                instance_id=spec.instance_id,
                state=e.state,
                detail=f"from warm pool {key}",
            )
            self._kick(slot, self.config.pool_refill_delay_s)
            return self.view(e)
        self._kick(slot)
        return None

    async def drain_pools(self) -> None:
        """Delete every pooled instance and forget the pools."""
        for key in list(self._pools()):
            await self.remove_pool(key)

    async def remove_pool(self, key: str) -> None:
        """Delete the pool's members and forget it (instances taken from it are not members:
        they stay). Removing an unknown pool succeeds."""
        slot = self._pools().get(key)
        if slot is None:
            return
        slot.size = 0
        if slot.refill is not None:
            slot.refill.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await slot.refill
        members = set(slot.ready) | {
            e.record.instance_id for e in self.entries.values() if e.record.pool == slot.key
        }
        for member in sorted(members):
            with contextlib.suppress(FleetError):
                await self.delete(member)  # type: ignore[attr-defined]
        slot.ready.clear()
        self._pools().pop(key, None)
