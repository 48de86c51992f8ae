"""Instance lifecycle: create (define), start, shutdown, force-off, reboot, suspend/resume,
delete, seed hand-off, serial log.

Every operation is idempotent (asking for the state an instance is already in is a no-op; deleting
what is gone succeeds) and a multi-step create either completes or removes every piece it made
(domain, overlay, seed, serial log, port, index entry): see `build.NewInstance`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid as uuidlib
from dataclasses import dataclass

from .build import NewInstance
from .context import FleetContext
from .domain_config import KernelPaths, control_address, domain_config, instance_record
from .driver import Domain, HostDriver, PowerState, require_reachable
from .errors import Conflict, FleetError, InvalidRequest, NotFound
from .hosts import HostRegistry
from .index import Entry, InstanceIndex
from .models import (
    FirmwareBoot,
    FleetEventKind,
    Instance,
    InstanceSpec,
    InstanceState,
    KernelBoot,
)
from .placement import PlacementRequest
from .states import SavedStates
from .transaction import Transaction

GiB = 1 << 30


async def lookup(host: HostDriver, e: Entry) -> Domain:
    return await host.lookup(e.record.domain, e.uuid)


async def power_on(index: InstanceIndex, host: HostDriver, e: Entry) -> None:
    """Start ``e`` (or resume it when paused); call with its lock held."""
    dom = await lookup(host, e)
    if await dom.is_active():
        if (await dom.status()).power is PowerState.PAUSED:
            await dom.resume()
            index.set_state(e, InstanceState.RUNNING, "resumed")
        return
    await dom.start()
    index.set_state(e, InstanceState.RUNNING, "started")


@dataclass(eq=False)
class Lifecycle:
    ctx: FleetContext
    index: InstanceIndex
    hosts: HostRegistry
    states: SavedStates

    # ------------------------------------------------------------------ queries

    async def get(self, instance_id: str) -> Instance:
        return self.index.view(self.index.entry(instance_id))

    async def list_instances(
        self, *, host: str | None = None, owner: str | None = None, include_pooled: bool = False
    ) -> list[Instance]:
        out = []
        for e in list(self.index.values()):
            if host is not None and e.record.host != host:
                continue
            if owner is not None and e.record.owner != owner:
                continue
            if e.record.pool and not include_pooled:
                continue
            out.append(self.index.view(e))
        return sorted(out, key=lambda i: i.instance_id)

    # ------------------------------------------------------------------ create

    async def create(self, spec: InstanceSpec, *, start: bool = True) -> Instance:
        """Define (and by default start) a new instance. Repeating the same request returns
        the existing instance; on failure nothing of it is left behind."""
        existing = self.index.reserve(
            spec.instance_id, lambda r: r.image == spec.image and r.owner == spec.owner
        )
        if existing is not None:
            async with existing.lock:
                if start and existing.state in (InstanceState.DEFINED, InstanceState.SHUTOFF):
                    await power_on(self.index, self.hosts.host(existing.record.host), existing)
            return self.index.view(existing)

        record = instance_record(spec, host="")
        name = record.domain
        entry = Entry(record=record, state=InstanceState.DEFINED)
        new = NewInstance(
            self.ctx, self.index, entry, f"create {spec.instance_id}", stage="placing"
        )
        # Every step below registers its undo with `new` as it is taken: a failure anywhere
        # (or a cancellation) removes what was made and raises naming the stage.
        async with new:
            new.step("placing")
            # reading every host's commitments and claiming one are one step, so parallel
            # creates see each other's claims and spread
            async with self.hosts.placement_lock:
                h = await self.hosts.place(
                    PlacementRequest(
                        vcpus=spec.resources.vcpus,
                        memory_mib=spec.resources.memory_mib,
                        labels=spec.host_labels,
                        anti_affinity=spec.anti_affinity,
                        pinned=spec.host,
                    )
                )
                record.host = h.name
            vol = h.volumes
            new.claim(h)
            # the image reaches the host it was placed on, once (a host cut off when it was
            # built, or added since, gets it here); kept on a failure below, as any base is
            for image_name, path in spec.image_files.items():
                await self.hosts.import_image(image_name, path, host=h.name)

            new.step("ports")
            new.allocate_port()

            # the stage is named before the checks (their errors are the disk stage's), the
            # observers and the fault seam hear of it just before the overlay is made
            new.tx.stage = "disk"
            if await h.domain_exists(name):
                raise Conflict(f"a domain named {name} already exists on {h.name}")
            base = await vol.image_path(spec.image)
            boot: KernelPaths | FirmwareBoot
            if isinstance(spec.boot, KernelBoot):
                kb = spec.boot
                kernel = await vol.image_path(kb.kernel)
                initrd = await vol.image_path(kb.initrd) if kb.initrd else None
                boot = KernelPaths(kernel, initrd, kb.cmdline)
            else:
                boot = spec.boot
            cap = spec.resources.disk_gib * GiB if spec.resources.disk_gib else None
            overlay_name = f"{name}.qcow2"
            # a leftover with no domain is an orphan
            await vol.delete(vol.path("instances", overlay_name))
            self.ctx.fault("disk")
            record.overlay = await vol.create_overlay("instances", overlay_name, base, cap)
            new.made_file("overlay", record.overlay)

            new.step("seed")
            await new.seed_and_serial_log(spec.seed)

            new.step("defining")
            # the same spec -> DomainConfig as the dry-run preview (`preview_domain_xml`)
            cfg = domain_config(
                spec,
                record,
                config=self.ctx.config,
                uuid=str(uuidlib.uuid4()),
                domain_type=h.domain_type,
                boot=boot,
                control=control_address(h.spec, self.ctx.config),
            )
            dom = await new.define(h.render(cfg))
            self.ctx.fault("defined")

            if start:
                new.step("booting")
                await dom.start()
                self.index.set_state(entry, InstanceState.RUNNING, "started")
        self.index.announce_created(entry)
        return self.index.view(entry)

    # ------------------------------------------------------------------ state changes

    def _live(self, instance_id: str) -> tuple[Entry, HostDriver]:
        e = self.index.entry(instance_id)
        return e, self.hosts.host(e.record.host)

    async def start(self, instance_id: str) -> Instance:
        e, h = self._live(instance_id)
        async with e.lock:
            self.index.check_live(e)
            await power_on(self.index, h, e)
        return self.index.view(e)

    async def shutdown(self, instance_id: str, *, grace_s: float | None = None) -> Instance:
        """Ask the guest to power off; after ``grace_s`` seconds, force it off."""
        e, h = self._live(instance_id)
        timeout = self.ctx.config.shutdown_timeout_s if grace_s is None else grace_s
        async with e.lock:
            self.index.check_live(e)
            dom = await lookup(h, e)
            if not await dom.is_active():
                return self.index.view(e)
            with contextlib.suppress(FleetError):
                await dom.shutdown()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while loop.time() < deadline:
                if not await dom.is_active():
                    break
                await asyncio.sleep(0.2)
            else:
                with contextlib.suppress(FleetError):
                    await dom.destroy()
                self.index.set_state(
                    e, InstanceState.SHUTOFF, f"forced off after {timeout:g}s graceful timeout"
                )
                return self.index.view(e)
            self.index.set_state(e, InstanceState.SHUTOFF, "guest shut down")
        return self.index.view(e)

    async def force_off(self, instance_id: str) -> Instance:
        e, h = self._live(instance_id)
        async with e.lock:
            self.index.check_live(e)
            dom = await lookup(h, e)
            if await dom.is_active():
                await dom.destroy()
            self.index.set_state(e, InstanceState.SHUTOFF, "powered off")
        return self.index.view(e)

    async def reboot(self, instance_id: str, *, hard: bool = False) -> Instance:
        """ACPI reboot request (the guest decides), or ``hard``: an immediate reset."""
        e, h = self._live(instance_id)
        async with e.lock:
            self.index.check_live(e)
            dom = await lookup(h, e)
            if not await dom.is_active():
                raise InvalidRequest(f"instance {instance_id} is not running")
            if hard:
                await dom.reset()
            else:
                await dom.reboot()
        return self.index.view(e)

    async def suspend(self, instance_id: str) -> Instance:
        e, h = self._live(instance_id)
        async with e.lock:
            self.index.check_live(e)
            dom = await lookup(h, e)
            if (await dom.status()).power is PowerState.PAUSED:
                return self.index.view(e)
            if not await dom.is_active():
                raise InvalidRequest(f"instance {instance_id} is not running")
            await dom.suspend()
            self.index.set_state(e, InstanceState.PAUSED, "suspended")
        return self.index.view(e)

    async def resume(self, instance_id: str) -> Instance:
        e, h = self._live(instance_id)
        async with e.lock:
            self.index.check_live(e)
            dom = await lookup(h, e)
            power = (await dom.status()).power
            if power is PowerState.RUNNING:
                return self.index.view(e)
            if power is not PowerState.PAUSED:
                raise InvalidRequest(f"instance {instance_id} is not paused")
            await dom.resume()
            self.index.set_state(e, InstanceState.RUNNING, "resumed")
        return self.index.view(e)

    # ------------------------------------------------------------------ delete

    async def delete(self, instance_id: str) -> None:
        """Remove the domain (with snapshots, managed save), overlay, seeds, serial logs and
        port. Deleting an instance that does not exist succeeds."""
        e = self.index.get(instance_id)
        if e is None:
            return
        async with e.lock:
            if self.index.get(instance_id) is not e:
                return
            h = self.hosts.host(e.record.host)
            require_reachable(h)  # refused, not begun: the instance stays as it was
            e.deleting = True
            key = (h.name, e.record.domain)
            self.index.inflight.add(key)
            try:
                self.ctx.fault("delete")
                await h.remove_domain(e.record.domain, e.uuid)
                await h.volumes.remove_instance_files(e.record)
            except BaseException:
                e.deleting = False
                raise
            finally:
                self.index.inflight.discard(key)
            h.ports.release(e.record.ssh_port)
            self.index.pop(instance_id)
        # a deleted state's frozen disk goes with the last instance backed by it
        await self.states.collect_frozen_disks(h)
        self.ctx.emit(
            FleetEventKind.INSTANCE_DELETED,
            host=e.record.host,
            instance_id=instance_id,
            incarnation=e.record.incarnation,
            detail="deleted",
        )

    # ------------------------------------------------------------------ identity hand-off

    async def set_seed(self, instance_id: str, seed: str | None) -> Instance:
        """Put a new seed ISO in the instance's seed drive (a media change the running guest
        sees), or eject it (``None``). This is how a clone or a pooled guest is handed its new
        identity: the layer above writes a seed with the new hostname, instance id, keys and
        enrollment token, and the in-guest agent re-reads it on the media change."""
        e, h = self._live(instance_id)
        async with e.lock:
            self.index.check_live(e)
            await self.set_seed_locked(h, e, seed)
        return self.index.view(e)

    async def set_seed_locked(self, h: HostDriver, e: Entry, seed: str | None) -> None:
        """`set_seed` with ``e``'s lock held: the new seed goes in under a name of its own
        (the old one may be open in the guest), then the record; the old seed file goes
        last. A step that fails removes the new file again."""
        vol = h.volumes
        dom = await lookup(h, e)
        old = e.record.seed
        new_path = None
        async with Transaction() as tx:
            if seed is not None:
                name = f"{e.record.domain}.seed-{secrets.token_hex(4)}.iso"
                path = new_path = await vol.put_file("instances", name, seed)
                tx.on_undo("seed", lambda: vol.delete(path))
            await dom.change_media(new_path)
            record = e.record.model_copy(update={"seed": new_path})
            await dom.set_record(record)
        e.record = record
        if old and old != new_path:
            await vol.delete(old)

    # ------------------------------------------------------------------ serial log

    async def read_serial_log(self, instance_id: str, offset: int = 0) -> bytes:
        """The serial console log from ``offset`` (works for remote hosts too)."""
        e, h = self._live(instance_id)
        try:
            return await h.volumes.read_range(e.record.serial_log, offset, None)
        except NotFound:
            return b""
