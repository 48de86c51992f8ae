"""Warm pool: per key (image + loadout), N instances restored from a saved state and kept
paused, so creating one is a metadata rewrite, an optional seed swap and a resume.

A new member runs for ``pool_warmup_s`` before it is paused: under TCG a freshly restored guest
spends its first few hundred milliseconds filling QEMU's translation cache, and that should happen
before a hand-off, not after. Refills start ``pool_refill_delay_s`` after a hand-off so they do not
compete with the guest just handed out.

A pool configured with ``Standby`` gives each new member a seed of its own (``Standby.seed``: the
server's, with the member's id and entropy) and keeps it running, after the warm-up, until its
console shows ``Standby.ready`` (at most ``pool_standby_wait_s``): the guest's agent then has
made, ahead, the key the hand-off's enrollment would otherwise wait for. A host with no real
guests (libvirt's test driver) is not waited for.

Pool members are ordinary fleet instances with ``record.pool`` set and ids ``pool-<hex>`` (hidden
from ``list_instances`` unless asked). Taking one re-keys it under the caller's instance id (the
libvirt domain keeps its ``sbx-pool-…`` name: libvirt cannot rename a running domain; the fleet
finds domains by the record in their metadata, not by name). Refills run in the background and
stop short of the configured size when the host's free memory (minus a headroom) runs out.

A pool given another saved state (`configure_pool` with a new ``state_id``: the server moves a
drained host's pools to a state captured elsewhere) keeps its old members as *retiring*: they are
still handed out while nothing newer is ready, each new member retires one of them, and the
last go when the pool is full of new ones. A refill that cannot make new members leaves the old
ones where they are (and says why in ``last_error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from .clones import Clones
from .context import FleetContext
from .errors import Conflict, FleetError, InvalidRequest, NotFound
from .hosts import HostRegistry
from .index import InstanceIndex
from .lifecycle import Lifecycle, lookup
from .models import (
    CloneSpec,
    EgressPolicy,
    FleetConfig,
    FleetEventKind,
    Instance,
    InstanceState,
    validate_name,
)
from .states import SavedStates
from .transaction import Transaction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Standby:
    """How a pool's members stand by (see the module doc). ``seed(member_id)`` writes that
    member's seed and returns its local path, which the fleet removes once it is copied."""

    seed: Callable[[str], Awaitable[str]]
    ready: tuple[bytes, ...]  # console lines of a member that is ready to be paused (any one)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.ready, tuple)
            or not self.ready
            or not all(isinstance(line, bytes) and line for line in self.ready)
        ):
            raise InvalidRequest("Standby.ready: a non-empty tuple of non-empty console lines")


@dataclass
class PoolSlot:
    key: str
    state_id: str
    size: int
    egress: EgressPolicy
    agent_port: int
    standby: Standby | None = None
    filling: str | None = None  # the member being made now (running until it is paused)
    ready: list[str] = field(default_factory=list)
    retiring: list[str] = field(default_factory=list)  # members of an earlier state
    refill: asyncio.Task[None] | None = None
    last_error: str = ""


@dataclass(frozen=True)
class PoolStatus:
    key: str
    state_id: str
    size: int
    ready: int  # members to hand out, retiring ones included
    last_error: str
    retiring: int = 0  # of ``ready``: members of an earlier state, replaced as new ones come


@dataclass(eq=False)
class WarmPool:
    ctx: FleetContext
    index: InstanceIndex
    hosts: HostRegistry
    states: SavedStates
    clones: Clones
    lifecycle: Lifecycle
    slots: dict[str, PoolSlot] = field(default_factory=dict, init=False)

    def users_of(self, state_id: str) -> list[str]:
        """The pools that keep clones of ``state_id``."""
        return [k for k, slot in self.slots.items() if slot.state_id == state_id and slot.size > 0]

    async def configure_pool(
        self,
        key: str,
        state_id: str,
        size: int,
        *,
        egress: EgressPolicy = EgressPolicy.ISOLATED,
        agent_port: int = 8120,
        standby: Standby | None = None,
        wait: bool = False,
    ) -> PoolStatus:
        """Keep ``size`` paused clones of ``state_id`` ready under ``key``. Members already in
        the fleet (after a restart) are taken back into the pool. ``size=0`` drains it.
        ``standby``: each new member's own seed, and the sign that it is ready to pause."""
        validate_name(key)
        if size < 0:
            raise InvalidRequest("size must be >= 0")
        if state_id not in self.states:
            raise NotFound(f"no saved state {state_id!r}")
        slot = self.slots.get(key)
        if slot is None:
            slot = PoolSlot(key, state_id, size, egress, agent_port, standby)
            self.slots[key] = slot
        else:
            if slot.state_id != state_id:  # replaced as new members come (see the module doc)
                slot.retiring.extend(slot.ready)
                slot.ready.clear()
            slot.state_id, slot.size, slot.egress, slot.agent_port, slot.standby = (
                state_id,
                size,
                egress,
                agent_port,
                standby,
            )
        stale: list[str] = []
        for e in self.index.values():
            member = e.record.instance_id
            if (
                e.record.pool != key
                or member in slot.ready
                or member in slot.retiring
                or member == slot.filling
            ):
                continue
            if e.state is InstanceState.PAUSED:
                slot.ready.append(member)
            elif e.state is InstanceState.RUNNING and not e.deleting:
                # made before a restart and never paused (the server stopped while it warmed
                # up or stood by): it cannot be told how far it got, so it is replaced
                stale.append(member)
        for member in stale:
            log.info("warm pool %s: %s was never paused; deleting it", key, member)
            try:
                await self.lifecycle.delete(member)
            except NotFound:
                pass
            except FleetError as exc:  # its host is away: the next configure tries again
                log.warning("warm pool %s: deleting %s failed: %s", key, member, exc)
        while len(slot.ready) + len(slot.retiring) > size and slot.retiring:
            await self._retire_one(slot)
        while len(slot.ready) > size:
            await self.lifecycle.delete(slot.ready.pop())
        self._kick(slot)
        if wait and slot.refill is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(slot.refill)
        return self._status(slot)

    def _status(self, slot: PoolSlot) -> PoolStatus:
        return PoolStatus(
            slot.key,
            slot.state_id,
            slot.size,
            len(slot.ready) + len(slot.retiring),
            slot.last_error,
            len(slot.retiring),
        )

    async def _retire_one(self, slot: PoolSlot) -> None:
        member = slot.retiring.pop()
        try:
            await self.lifecycle.delete(member)
        except NotFound:
            pass
        except FleetError as e:  # its host is away: the member stays, out of the pool
            log.warning("warm pool %s: retiring %s failed: %s", slot.key, member, e)

    async def pool_status(self) -> list[PoolStatus]:
        return [self._status(s) for s in self.slots.values()]

    def _kick(self, slot: PoolSlot, delay: float = 0.0) -> None:
        if slot.refill is None or slot.refill.done():
            slot.refill = self.ctx.spawn(self._refill(slot, delay))

    async def _refill(self, slot: PoolSlot, delay: float = 0.0) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        config = self.ctx.config
        await self._refill_to_size(slot, config)
        while slot.retiring and len(slot.ready) >= slot.size and not self.ctx.closed:
            await self._retire_one(slot)

    async def _refill_to_size(self, slot: PoolSlot, config: FleetConfig) -> None:
        while len(slot.ready) < slot.size and not self.ctx.closed:
            st = self.states.get(slot.state_id)
            if st is None:
                slot.last_error = f"saved state {slot.state_id} is gone"
                return
            h = self.hosts.host(st.host)
            try:
                free_mib = await h.free_memory_mib()
            except FleetError as e:
                slot.last_error = str(e)
                return
            if free_mib - st.memory_mib < config.pool_memory_headroom_mib:
                slot.last_error = (
                    f"host {h.name}: {free_mib} MiB free, not refilling below "
                    f"{config.pool_memory_headroom_mib} MiB headroom"
                )
                return
            token = secrets.token_hex(5)
            member = f"pool-{token}"
            standby = slot.standby
            warmup = config.pool_warmup_s
            seed: str | None = None
            slot.filling = member
            try:
                # The member is one more multi-step operation: restored, warmed up, paused;
                # a step that fails deletes what there is of it (the clone cleans up after
                # itself; a member that was restored but not paused is deleted here).
                async with Transaction() as tx:
                    if standby is not None:
                        seed = await self._standby_seed(standby, member)
                    tx.on_undo("member", partial(self.lifecycle.delete, member))
                    await self.clones.clone_from_state(
                        slot.state_id,
                        CloneSpec(
                            instance_id=member,
                            egress=slot.egress,
                            agent_port=slot.agent_port,
                            restart_on_crash=False,
                            seed=seed,
                        ),
                        paused=warmup <= 0 and standby is None,
                        pool=slot.key,
                        domain=f"sbx-pool-{token}",
                    )
                    if warmup > 0 or standby is not None:
                        await asyncio.sleep(warmup)
                        if standby is not None and not h.virtual:
                            await self._stand_by(member, standby.ready, config)
                        await self.lifecycle.suspend(member)
            except (FleetError, OSError) as e:
                slot.last_error = str(e)
                log.warning("warm pool %s: refill failed: %s", slot.key, e)
                return
            finally:
                slot.filling = None
                if seed is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(seed)
            slot.ready.append(member)
            slot.last_error = ""
            if slot.retiring and len(slot.ready) + len(slot.retiring) > slot.size:
                await self._retire_one(slot)  # a new member in, an old one out
            self.ctx.emit(
                FleetEventKind.POOL_REFILLED,
                host=h.name,
                instance_id=member,
                detail=f"pool {slot.key}: {len(slot.ready)}/{slot.size}",
            )

    @staticmethod
    async def _standby_seed(standby: Standby, member: str) -> str:
        """The member's own seed from the server's factory; whatever it raises is this refill's
        named error (the pool's ``last_error``), not an end of the refill task."""
        try:
            return await standby.seed(member)
        except Exception as exc:
            raise FleetError(f"the standby seed of {member} could not be made: {exc}") from exc

    async def _stand_by(self, member: str, ready: tuple[bytes, ...], config: FleetConfig) -> None:
        """Until the member's console shows one of ``ready`` (its agent made its spare key, or
        says it makes none), or ``pool_standby_wait_s`` have passed: a member paused before
        that still works, and makes the rest of its key after the hand-off. A console that
        cannot be read is not waited for (the member is paused, not lost)."""
        deadline = time.monotonic() + config.pool_standby_wait_s
        offset, tail = 0, b""
        while True:
            try:
                chunk = await self.lifecycle.read_serial_log(member, offset)
            except (FleetError, OSError) as exc:
                log.info("pool member %s: its console cannot be read (%s); pausing it", member, exc)
                return
            offset += len(chunk)
            seen = tail + chunk
            if any(line in seen for line in ready):
                return
            tail = seen[-max(len(line) for line in ready) :]
            if time.monotonic() >= deadline:
                log.info("pool member %s: no %r on its console; pausing it anyway", member, ready)
                return
            await asyncio.sleep(0.2)

    async def take_from_pool(
        self,
        key: str,
        spec: CloneSpec,
        *,
        bind_seed: Callable[[str], Awaitable[object]] | None = None,
    ) -> Instance | None:
        """Hand a pooled, paused instance to ``spec.instance_id`` and resume it; ``None`` when
        the pool is empty (the caller then uses ``clone_from_state``). ``bind_seed(member)``
        marks ``spec.seed`` as the hand-off of the member picked, before it goes in: only such a
        seed lets the member's agent use the key it made standing by (a failure is logged, and
        the agent then makes a fresh key)."""
        slot = self.slots.get(key)
        if slot is None:
            raise NotFound(f"no warm pool {key!r}")
        if spec.egress != slot.egress or spec.agent_port != slot.agent_port:
            raise InvalidRequest(
                f"pool {key} serves egress={slot.egress.value} agent_port={slot.agent_port}"
            )
        if spec.instance_id in self.index:
            raise Conflict(f"instance {spec.instance_id!r} already exists")
        while slot.ready or slot.retiring:
            member = slot.ready.pop(0) if slot.ready else slot.retiring.pop(0)
            e = self.index.get(member)
            if e is None or e.deleting or e.state is not InstanceState.PAUSED:
                continue
            async with e.lock:
                h = self.hosts.host(e.record.host)
                old = e.record
                record = old.model_copy(
                    update={
                        "instance_id": spec.instance_id,
                        "owner": spec.owner,
                        "incarnation": spec.incarnation,
                        "loadout": spec.loadout or old.loadout,
                        "pool": None,
                        "restart_on_crash": spec.restart_on_crash,
                    }
                )
                dom = None
                try:
                    dom = await lookup(h, e)
                    # re-key first so events from the resume find the new id
                    self.index.rekey(e, record)
                    # Resume first: the guest runs while the host writes its config, and a
                    # media change (the new seed) needs a running guest to release the tray —
                    # on a paused one QEMU waits for the eject until it times out.
                    self.ctx.fault("booting")
                    await dom.resume()
                    if spec.seed:
                        if bind_seed is not None:
                            await self._bind(bind_seed, old.instance_id)
                        await self.lifecycle.set_seed_locked(h, e, spec.seed)
                    await dom.set_record(record)
                except (FleetError, OSError) as err:  # OSError: a local seed copy
                    log.warning(
                        "warm pool %s: hand-off of %s failed: %s", key, old.instance_id, err
                    )
                    # Off at once, not only when its delete comes round: resumed, perhaps with
                    # the caller's seed in its drive, its agent would enroll with that seed's
                    # one-time token (with its spare key, quickly), racing the member or clone
                    # the caller is handed next. Then the member it was again (its pool, no
                    # owner), in the index and in its domain's metadata, so that a delete that
                    # fails leaves a pool member for reconciliation, not the caller's instance.
                    back = old.model_copy(update={"seed": e.record.seed})
                    if dom is not None:
                        with contextlib.suppress(FleetError):
                            await dom.destroy()
                        with contextlib.suppress(FleetError):
                            await dom.set_record(back)
                    self.index.rekey(e, back)
                    self.index.set_state(e, InstanceState.SHUTOFF, f"hand-off failed: {err}")
                    self.ctx.spawn(self.lifecycle.delete(old.instance_id))
                    continue
                self.index.set_state(e, InstanceState.RUNNING, f"taken from warm pool {key}")
            self.index.announce_created(e, f"from warm pool {key}")
            self._kick(slot, self.ctx.config.pool_refill_delay_s)
            return self.index.view(e)
        self._kick(slot)
        return None

    @staticmethod
    async def _bind(bind_seed: Callable[[str], Awaitable[object]], member: str) -> None:
        try:
            await bind_seed(member)
        except Exception as exc:  # the caller's: an unbound seed only costs the spare key
            log.warning("binding the hand-off's seed to %s failed: %s", member, exc)

    async def drain_pools(self) -> None:
        """Delete every pooled instance and forget the pools."""
        for key in list(self.slots):
            await self.remove_pool(key)

    async def remove_pool(self, key: str) -> None:
        """Delete the pool's members and forget it (instances taken from it are not members:
        they stay). Removing an unknown pool succeeds."""
        slot = self.slots.get(key)
        if slot is None:
            return
        slot.size = 0
        if slot.refill is not None:
            slot.refill.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await slot.refill
        members = (
            set(slot.ready)
            | set(slot.retiring)
            | {e.record.instance_id for e in self.index.values() if e.record.pool == slot.key}
        )
        for member in sorted(members):
            with contextlib.suppress(FleetError):
                await self.lifecycle.delete(member)
        slot.ready.clear()
        slot.retiring.clear()
        self.slots.pop(key, None)

    def stop(self) -> None:
        """Stop refilling (the fleet is closing)."""
        for slot in self.slots.values():
            if slot.refill is not None:
                slot.refill.cancel()
