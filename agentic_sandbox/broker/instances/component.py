"""The fleet inside the server: libvirt hosts, the instance mirror, provisioning, images.

The fleet (libvirt) is the truth about domains; the `instances` table mirrors it for the API
(owners, listing, filters) and is fed by fleet events (`mirror.py`). Provisioning, image builds
and pool preparations run as operations. This module builds the parts, starts and stops them
and installs the admin routes (`api/`), which reach the services through `keys.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from sqlalchemy import select

from agentic_sandbox.broker.app import StartupError
from agentic_sandbox.broker.instances import api, keys
from agentic_sandbox.broker.instances.access import FleetGate
from agentic_sandbox.broker.instances.hosts import LOCAL_HOST, HostService
from agentic_sandbox.broker.instances.images import ImageCatalog
from agentic_sandbox.broker.instances.loadouts import Loadouts
from agentic_sandbox.broker.instances.mirror import InstanceMirror
from agentic_sandbox.broker.instances.operations import Operations
from agentic_sandbox.broker.instances.pools import WarmPools
from agentic_sandbox.broker.instances.provisioning import Provisioning
from agentic_sandbox.broker.instances.service import InstanceService
from agentic_sandbox.broker.instances.snapshots import SnapshotService
from agentic_sandbox.broker.operations import OperationRunner
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import Fleet, FleetConfig, FleetError, FleetEvent, traversal_problem
from agentic_sandbox.provision import Enroller, ProvisionError

log = logging.getLogger(__name__)


class FleetComponent:
    name = "fleet"

    def __init__(
        self, svc: Services, enroller_factory: Callable[[], Enroller | None] | None = None
    ) -> None:
        self.svc = svc
        s = svc.settings
        self._enroller_factory = enroller_factory
        self.images_dir = s.effective_images_dir
        self.ops = OperationRunner(svc)
        self.fleet = Fleet(
            FleetConfig(
                data_dir=str(s.data_dir / "fleet"),
                qemu_group=s.qemu_group or None,
                default_uri=s.libvirt_uri or "test:///default",
                pool_refill_delay_s=s.pool_refill_delay_seconds,
                keepalive_interval_s=s.host_keepalive_seconds,
                keepalive_count=s.host_keepalive_count,
                reconnect_max_s=s.host_reconnect_max_seconds,
                reconnect_initial_s=min(0.2, s.host_reconnect_max_seconds),
            ),
            on_event=self._on_event,
            on_call=self._on_call,
        )
        self.gate = FleetGate(self.fleet, enabled=s.libvirt_enabled)
        self.access_problem = ""
        self.mirror = InstanceMirror(svc, self.fleet)
        self.provisioning = Provisioning(svc, self.fleet, self.gate, self.ops)
        self.images = ImageCatalog(svc, self.ops, self.images_dir)
        self.loadouts = Loadouts(svc, s.effective_loadouts_dir)
        self.hosts = HostService(svc, self.gate)
        self.pools = WarmPools(
            svc,
            self.fleet,
            self.gate,
            self.ops,
            provisioning=self.provisioning,
            images=self.images,
            loadouts=self.loadouts,
        )
        self.snapshots = SnapshotService(svc, self.gate)
        self.instances = InstanceService(
            svc,
            self.gate,
            images=self.images,
            loadouts=self.loadouts,
            pools=self.pools,
            snapshots=self.snapshots,
            provisioning=self.provisioning,
        )
        self.operations = Operations(svc, self.ops)

    # ---- lifecycle -----------------------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        app[keys.INSTANCES] = self.instances
        app[keys.SNAPSHOTS] = self.snapshots
        app[keys.HOSTS] = self.hosts
        app[keys.IMAGES] = self.images
        app[keys.LOADOUTS] = self.loadouts
        app[keys.POOLS] = self.pools
        app[keys.OPERATIONS] = self.operations
        api.install(app)

    async def start(self) -> None:
        """Start in an order that never lets a guest boot wrong: the server's SSH key and the
        operations first; without libvirt, only the clean-up of interrupted provisions. With
        it: the seed folder, a checked agent bundle (a broken one stops the start), the QEMU
        access check, then the fleet opens (adopting the domains the table knows), interrupted
        provisions are cleaned up, the table made to agree with the fleet, the warm pools
        restored, and saved states nothing refers to deleted."""
        await self.loadouts.seed()  # the shipped files: version 1 of their names
        await self.provisioning.ensure_ssh_key()
        await self.ops.start()
        self.mirror.start()
        if self._enroller_factory is not None:
            self.provisioning.enroller = self._enroller_factory()
        if not self.gate.enabled:

            async def disabled() -> tuple[bool, str]:
                return True, "disabled (SANDBOX_LIBVIRT_URI is empty)"

            self.svc.readiness["libvirt"] = disabled
            await self.provisioning.recover_interrupted()
            return
        self.svc.readiness["libvirt"] = self._ready
        await asyncio.to_thread(self.provisioning.provisioner.prepare)
        try:  # a guest must never boot with an agent that cannot start
            await self.provisioning.provisioner.check_bundle()
        except ProvisionError as exc:
            raise StartupError(f"cannot provision VMs: {exc.cause}") from None
        # QEMU runs as libvirt-qemu: every parent of the fleet's data must be traversable by
        # it (by group or by others)
        self.access_problem = traversal_problem(self.svc.settings.data_dir / "fleet")
        if self.access_problem:
            log.error("%s", self.access_problem)
        await self.fleet.open(await self.hosts.specs(), known=await self.mirror.known_records())
        self.gate.opened = True
        await self.hosts.restore_draining()
        for info in await self.fleet.list_hosts():
            accel = self.fleet.accel(info.spec.name)
            if accel is not None:
                log.info(
                    "host %s runs guests with %s (%s)",
                    info.spec.name,
                    accel.accel.value if hasattr(accel.accel, "value") else accel.accel,
                    accel.reason,
                )
        await self.provisioning.recover_interrupted()
        await self.mirror.sync()
        await self.pools.restore()
        await self._delete_unowned_states()

    async def _delete_unowned_states(self) -> None:
        """Saved states that no snapshot or pool refers to (a crash between making one and
        recording it, or an older version that dropped the row) are deleted like any other:
        the memory image now, the frozen disk with the last instance backed by it."""
        async with self.svc.db.session() as s:
            details = (await s.scalars(select(m.Snapshot.detail))).all()
        owned = {str(d["state_id"]) for d in details if d and d.get("state_id")}
        owned |= {p.state_id for p in await self.pools.saved()}
        for st in await self.fleet.list_states():
            if st.state_id in owned:
                continue
            try:
                await self.fleet.delete_state(st.state_id)
                log.warning("deleted saved state %s: no snapshot or pool refers to it", st.state_id)
            except FleetError as exc:
                log.warning("saved state %s refers to nothing but stays: %s", st.state_id, exc)

    async def stop(self) -> None:
        await self.ops.stop()
        self.mirror.stop()
        if self.gate.opened:
            await self.fleet.close()

    async def _ready(self) -> tuple[bool, str]:
        if self.access_problem:
            return False, self.access_problem
        hosts = await self.fleet.list_hosts()
        local = next((h for h in hosts if h.spec.name == LOCAL_HOST), None)
        if local is None:
            return False, "no local host"
        if not local.reachable:
            return False, f"libvirt at {local.spec.uri} unreachable: {local.reason}"
        accel = local.accel.value if local.accel is not None else "unknown"
        return True, f"{local.spec.uri} reachable; guests run with {accel} ({local.accel_reason})"

    # ---- the fleet's callbacks -----------------------------------------------------------------
    def _on_call(self, operation: str, seconds: float, ok: bool) -> None:
        self.svc.metrics.libvirt_call.labels(operation).observe(seconds)
        if not ok:
            self.svc.metrics.libvirt_errors.labels(operation).inc()

    def _on_event(self, ev: FleetEvent) -> None:
        self.mirror.on_event(ev)
