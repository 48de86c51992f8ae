"""The fleet inside the server: libvirt hosts, the instance mirror, provisioning, images.

The fleet (libvirt) is the truth about domains; the `instances` table mirrors it for the API
(owners, listing, filters) and is fed by fleet events. Provisioning runs as operations. Image
builds run as operations too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlalchemy import select

from agentic_sandbox.broker.app import StartupError
from agentic_sandbox.broker.operations import OperationFailed, OperationRunner, Progress
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import (
    Fleet,
    FleetConfig,
    FleetError,
    FleetEvent,
    HostSpec,
    InstanceRecord,
    traversal_problem,
)
from agentic_sandbox.images import ImageBuilder, ImageStore
from agentic_sandbox.provision import (
    STAGES,
    Enroller,
    LoadoutCatalog,
    Provisioner,
    ProvisionError,
    ProvisionRequest,
    load_catalog,
)
from agentic_sandbox.provision.ssh import diagnose as ssh_diagnose
from agentic_sandbox.provision.ssh import ensure_key

log = logging.getLogger(__name__)

LOCAL_HOST = "local"
FLEET_KEY: web.AppKey[FleetComponent] = web.AppKey("fleet_component")


class FleetComponent:
    name = "fleet"

    def __init__(
        self, svc: Services, enroller_factory: Callable[[], Enroller | None] | None = None
    ) -> None:
        self.svc = svc
        s = svc.settings
        self.enabled = s.libvirt_enabled
        self._enroller_factory = enroller_factory
        self.enroller: Enroller | None = None
        self.images_dir = s.effective_images_dir
        self.image_store = ImageStore(self.images_dir)
        self.builder = ImageBuilder(self.images_dir)
        self.loadouts: LoadoutCatalog = load_catalog([s.effective_loadouts_dir])
        self.ops = OperationRunner(svc)
        self.fleet = Fleet(
            FleetConfig(
                data_dir=str(s.data_dir / "fleet"),
                qemu_group=s.qemu_group or None,
                default_uri=s.libvirt_uri or "test:///default",
                pool_refill_delay_s=s.pool_refill_delay_seconds,
            ),
            on_event=self._on_event,
            on_call=self._on_call,
        )
        self.ssh_key_path = s.data_dir / "ssh" / "id_ed25519"
        self.ssh_public_key = ""
        self.provisioner = Provisioner(
            self.fleet,
            s.data_dir / "provision",
            agent_port=s.guest_link_address[1],
            diagnose=self._diagnose,
        )
        self.opened = False
        self.access_problem = ""
        self._provision_slots = asyncio.Semaphore(s.max_concurrent_provisions)
        self._tasks: set[asyncio.Task[Any]] = set()
        svc.metrics.provide(
            "sandbox_hosts",
            "Hypervisor hosts by reachability",
            ("state",),
            self._host_gauge,
        )
        self._hosts_reachable: dict[tuple[str, ...], float] = {}
        self._mirror_queue: asyncio.Queue[FleetEvent] = asyncio.Queue(maxsize=100_000)

    # ---- lifecycle -----------------------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        from agentic_sandbox.broker.instances import routes

        app[FLEET_KEY] = self
        routes.api.install(app)

    async def _diagnose(self, inst: Any) -> str:
        port = inst.record.ssh_port
        if not port or not self.ssh_key_path.exists():
            return "no SSH forward to diagnose through"
        return await ssh_diagnose(port, self.ssh_key_path)

    async def start(self) -> None:
        self.ssh_public_key = await asyncio.to_thread(ensure_key, self.ssh_key_path)
        await self.ops.start()
        self._spawn(self._mirror_loop())
        if self._enroller_factory is not None:
            self.enroller = self._enroller_factory()
        if not self.enabled:

            async def disabled() -> tuple[bool, str]:
                return True, "disabled (SANDBOX_LIBVIRT_URI is empty)"

            self.svc.readiness["libvirt"] = disabled
            await self._recover_interrupted_provisions()
            return
        self.svc.readiness["libvirt"] = self._ready
        await asyncio.to_thread(self.provisioner.prepare)
        try:  # a guest must never boot with an agent that cannot start
            await self.provisioner.check_bundle()
        except ProvisionError as exc:
            raise StartupError(f"cannot provision VMs: {exc.cause}") from None
        self.access_problem = self._qemu_access_problem()
        if self.access_problem:
            log.error("%s", self.access_problem)
        hosts = await self._host_specs()
        known = await self._known_records()
        await self.fleet.open(hosts, known=known)
        self.opened = True
        for info in await self.fleet.list_hosts():
            accel = self.fleet.accel(info.spec.name)
            if accel is not None:
                log.info(
                    "host %s runs guests with %s (%s)",
                    info.spec.name,
                    accel.accel.value if hasattr(accel.accel, "value") else accel.accel,
                    accel.reason,
                )
        await self._recover_interrupted_provisions()
        await self._sync_mirror()
        from agentic_sandbox.broker.instances import pools

        await pools.restore_pools(self)
        await self._delete_unowned_states()

    async def _delete_unowned_states(self) -> None:
        """Saved states that no snapshot or pool refers to (a crash between making one and
        recording it, or an older version that dropped the row) are deleted like any other:
        the memory image now, the frozen disk with the last instance backed by it."""
        from agentic_sandbox.broker.instances import pools

        async with self.svc.db.session() as sess:
            details = (await sess.scalars(select(m.Snapshot.detail))).all()
        owned = {str(d["state_id"]) for d in details if d and d.get("state_id")}
        owned |= {str(p.get("state_id")) for p in await pools.saved_pools(self)}
        for st in await self.fleet.list_states():
            if st.state_id in owned:
                continue
            try:
                await self.fleet.delete_state(st.state_id)
                log.warning("deleted saved state %s: no snapshot or pool refers to it", st.state_id)
            except FleetError as exc:
                log.warning("saved state %s refers to nothing but stays: %s", st.state_id, exc)

    async def _recover_interrupted_provisions(self) -> None:
        """Provisions the server was running when it stopped (a kill -9, a crash) cannot be
        resumed: each is abandoned as a failed one would be — its half-made VM deleted, its
        record removed, its incarnation ended (the token in its seed no longer enrolls) — and
        the seeds left behind are removed."""
        async with self.svc.db.session() as sess:
            rows = (
                await sess.scalars(
                    select(m.Instance).where(
                        m.Instance.state == "provisioning", m.Instance.deleted_at.is_(None)
                    )
                )
            ).all()
            interrupted = [(r.id, r.incarnation) for r in rows]
        for instance_id, incarnation in interrupted:
            log.warning(
                "provision of %s was interrupted by a server restart; cleaning it up",
                instance_id,
                extra={"instance_id": instance_id},
            )
            if self.opened:
                try:
                    await self.fleet.delete(instance_id)
                except Exception:
                    log.exception("deleting the half-made %s failed", instance_id)
            await self.abandon(instance_id, incarnation, "server", "the server restarted")
            self.svc.events.publish(
                "instance.provision_failed",
                actor="server",
                instance_id=instance_id,
                data={"stage": "unknown", "cause": "the server restarted during provisioning"},
            )
        seeds = self.provisioner.work_dir / "seeds"
        for stale in seeds.glob("*.iso*") if seeds.is_dir() else ():
            stale.unlink(missing_ok=True)

    async def stop(self) -> None:
        await self.ops.stop()
        for t in list(self._tasks):
            t.cancel()
        if self.opened:
            await self.fleet.close()

    def _qemu_access_problem(self) -> str:
        """QEMU runs as libvirt-qemu: every parent of the fleet's data must be traversable by
        it (by group or by others)."""
        return traversal_problem(self.svc.settings.data_dir / "fleet")

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

    def _host_gauge(self) -> dict[tuple[str, ...], float]:
        return self._hosts_reachable

    async def _host_specs(self) -> list[HostSpec]:
        s = self.svc.settings
        specs = [
            HostSpec(name=LOCAL_HOST, uri=s.libvirt_uri, accel="auto" if s.kvm_probe else "tcg")
        ]
        async with self.svc.db.session() as sess:
            rows = (await sess.scalars(select(m.Host))).all()
            for row in rows:
                if row.name == LOCAL_HOST:
                    continue
                specs.append(self.host_spec_from_row(row))
            if not any(r.name == LOCAL_HOST for r in rows):
                sess.add(m.Host(name=LOCAL_HOST, uri=s.libvirt_uri, labels={}, owner="admin"))
        return specs

    @staticmethod
    def host_spec_from_row(row: m.Host) -> HostSpec:
        capacity: dict[str, Any] = {}
        if row.capacity_vcpus:
            capacity["vcpus"] = row.capacity_vcpus
        if row.capacity_memory_mib:
            capacity["memory_mib"] = row.capacity_memory_mib
        extra = dict(row.labels or {})
        spec_extra = extra.pop("_spec", {}) if isinstance(extra.get("_spec"), dict) else {}
        return HostSpec(name=row.name, uri=row.uri, labels=extra, capacity=capacity, **spec_extra)

    async def _known_records(self) -> list[InstanceRecord]:
        out = []
        async with self.svc.db.session() as sess:
            rows = (
                await sess.scalars(select(m.Instance).where(m.Instance.deleted_at.is_(None)))
            ).all()
        for row in rows:
            rec = (row.spec or {}).get("fleet_record")
            if rec:
                try:
                    out.append(InstanceRecord.model_validate(rec))
                except Exception:
                    log.warning("ignoring an unreadable fleet record for %s", row.id)
        return out

    async def _sync_mirror(self) -> None:
        """After open/reconcile: make the table agree with what the fleet found."""
        instances = await self.fleet.list_instances()
        seen = set()
        async with self.svc.db.session() as sess:
            for inst in instances:
                seen.add(inst.instance_id)
                row = await sess.get(m.Instance, inst.instance_id)
                if row is None:
                    row = m.Instance(
                        id=inst.instance_id,
                        incarnation=inst.record.incarnation or m.new_incarnation(),
                        owner=inst.record.owner or "admin",
                        state=inst.state.value,
                    )
                    sess.add(row)
                elif inst.record.incarnation and inst.record.incarnation != row.incarnation:
                    log.warning(
                        "domain of %s records incarnation %s, the database %s",
                        inst.instance_id,
                        inst.record.incarnation,
                        row.incarnation,
                        extra={"instance_id": inst.instance_id},
                    )
                self._apply_record(row, inst.record, inst.state.value, inst.state_reason)

    @staticmethod
    def _apply_record(row: m.Instance, rec: InstanceRecord, state: str, reason: str) -> None:
        row.host = rec.host
        row.image = rec.image.removesuffix(".qcow2") if rec.image else row.image
        row.loadout = rec.loadout or row.loadout
        row.vcpus = rec.vcpus
        row.memory_mib = rec.memory_mib
        row.ssh_port = rec.ssh_port
        row.network_policy = rec.egress.value
        row.state = state
        row.state_reason = reason
        spec = dict(row.spec or {})
        spec["fleet_record"] = rec.model_dump(mode="json")
        row.spec = spec

    # ---- fleet events → mirror, events, audit --------------------------------------------------
    def _on_call(self, operation: str, seconds: float, ok: bool) -> None:
        self.svc.metrics.libvirt_call.labels(operation).observe(seconds)
        if not ok:
            self.svc.metrics.libvirt_errors.labels(operation).inc()

    def _on_event(self, ev: FleetEvent) -> None:
        kind = ev.kind.value
        if kind.startswith("host."):
            self.svc.events.publish(kind, host=ev.host, data={"detail": ev.detail})
            if kind in ("host.unreachable", "host.reconnected", "host.added", "host.removed"):
                self._spawn(self._refresh_hosts())
            return
        if ev.instance_id is None:
            if kind.startswith(("fleet.", "pool.")):
                log.info("fleet: %s %s", kind, ev.detail)
            return
        try:
            self._mirror_queue.put_nowait(ev)  # one consumer: the mirror sees events in order
        except asyncio.QueueFull:
            log.error("fleet event backlog full; dropped %s for %s", kind, ev.instance_id)

    async def _mirror_loop(self) -> None:
        while True:
            ev = await self._mirror_queue.get()
            try:
                await self._mirror_event(ev)
            except Exception:
                log.exception("mirroring %s failed", ev.kind.value)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_hosts(self) -> None:
        hosts = await self.fleet.list_hosts()
        counts: dict[tuple[str, ...], float] = {("reachable",): 0.0, ("unreachable",): 0.0}
        async with self.svc.db.session() as sess:
            for info in hosts:
                counts[("reachable" if info.reachable else "unreachable",)] += 1
                row = await sess.get(m.Host, info.spec.name)
                if row is not None:
                    row.state = "reachable" if info.reachable else "unreachable"
                    row.state_reason = info.reason
        self._hosts_reachable = counts

    async def _mirror_event(self, ev: FleetEvent) -> None:
        assert ev.instance_id is not None
        kind = ev.kind.value
        owner: str | None = None
        async with self.svc.db.session() as sess:
            row = await sess.get(m.Instance, ev.instance_id)
            if row is not None:
                owner = row.owner
                before = row.state
                if kind == "instance.deleted":
                    if row.deleted_at is None:
                        row.deleted_at = dt.datetime.now(dt.UTC)
                        row.state = "deleted"
                elif ev.state is not None and row.state != "provisioning":
                    row.state = ev.state.value
                    row.state_reason = ev.detail
                elif ev.state is not None:
                    row.state_reason = ev.detail
                if row.state != before:
                    self.svc.audit.transition(
                        "fleet", "instance", row.id, before, row.state, cause=ev.detail or kind
                    )
        if not kind.startswith("instance."):
            kind = "instance." + kind.replace(
                ".", "_"
            )  # snapshot.created → instance.snapshot_created
        self.svc.events.publish(
            kind,
            actor="fleet",
            instance_id=ev.instance_id,
            host=ev.host,
            owner=owner,
            data={"state": ev.state.value if ev.state else None, "detail": ev.detail},
        )

    # ---- provisioning ---------------------------------------------------------------------------
    async def abandon(self, instance_id: str, incarnation: str, actor: str, reason: str) -> None:
        """Nothing is left of a failed, canceled or abandoned provision: its record goes and its
        incarnation ends (tokens and certificates revoked, a link that came up closed, anything
        bound to it meanwhile dropped)."""
        async with self.svc.db.session() as sess:
            row = await sess.get(m.Instance, instance_id)
            if row is not None and row.incarnation == incarnation:
                await sess.delete(row)
        if incarnation:
            await self.svc.incarnations.end(
                instance_id, incarnation, actor=actor, reason=f"provision failed: {reason}"
            )

    async def submit_provision(
        self, req: ProvisionRequest, *, actor: str, source_label: str
    ) -> m.Operation:
        if self.ssh_public_key and self.ssh_public_key not in req.ssh_keys:
            # the server's own key, for diagnosis over the instance's loopback SSH forward
            req = dataclasses.replace(req, ssh_keys=(*req.ssh_keys, self.ssh_public_key))

        async def body(progress: Progress) -> dict[str, Any]:
            async with self._provision_slots:
                return await self._provision(req, progress, actor, source_label)

        return await self.ops.submit(
            kind="provision",
            subject_type="instance",
            subject_id=req.instance_id,
            owner=req.owner,
            actor=actor,
            body=body,
            planned=STAGES,
        )

    async def _provision(
        self, req: ProvisionRequest, progress: Progress, actor: str, source_label: str
    ) -> dict[str, Any]:
        metrics = self.svc.metrics

        def on_stage(name: str, records: list[Any]) -> None:
            progress.stage(name, [r.as_dict(records[0].started) for r in records])

        try:
            result = await self.provisioner.provision(req, self.enroller, on_stage)
        except asyncio.CancelledError:
            await asyncio.shield(self.abandon(req.instance_id, req.incarnation, actor, "canceled"))
            raise
        except ProvisionError as exc:
            progress.stages = exc.stages or progress.stages
            metrics.provisions.labels(source_label, "failed").inc()
            await self.abandon(req.instance_id, req.incarnation, actor, f"{exc.stage}: {exc.cause}")
            self.svc.audit.record(
                actor,
                "instance.provision",
                "instance",
                req.instance_id,
                outcome="failed",
                cause=f"{exc.stage}: {exc.cause}",
            )
            self.svc.events.publish(
                "instance.provision_failed",
                actor=actor,
                owner=req.owner,
                instance_id=req.instance_id,
                data={"stage": exc.stage, "cause": exc.cause},
            )
            detail = {"diagnostics": exc.diagnostics[-8000:]} if exc.diagnostics else {}
            raise OperationFailed(exc.stage, exc.cause, detail) from None
        progress.stages = result.stages
        for stage in result.stages:
            if stage["seconds"] is not None:
                metrics.provision_stage.labels(stage["name"], "ok").observe(stage["seconds"])
        metrics.provisions.labels(source_label, "succeeded").inc()
        inst = result.instance
        async with self.svc.db.session() as sess:
            row = await sess.get(m.Instance, req.instance_id)
            if row is not None:
                self._apply_record(row, inst.record, inst.state.value, "provisioned")
                row.agent_state = (
                    "connected" if req.wait_ready and self.enroller else row.agent_state
                )
        self.svc.audit.transition(
            actor,
            "instance",
            req.instance_id,
            "provisioning",
            inst.state.value,
            cause=f"provisioned from {source_label} in {result.seconds:.1f}s",
        )
        self.svc.events.publish(
            "instance.ready",
            actor=actor,
            owner=req.owner,
            instance_id=req.instance_id,
            host=inst.host,
            data={
                "source": source_label,
                "seconds": round(result.seconds, 3),
                "stages": result.stages,
            },
        )
        return {
            "instance_id": req.instance_id,
            "host": inst.host,
            "source": source_label,
            "seconds": round(result.seconds, 3),
            "stages": result.stages,
        }

    # ---- images ----------------------------------------------------------------------------------
    async def submit_image_build(self, recipe: str, *, owner: str, actor: str) -> m.Operation:
        name = self.builder.image_name(recipe)

        async def body(progress: Progress) -> dict[str, Any]:
            loop = asyncio.get_running_loop()
            started = loop.time()

            def on_progress(p: Any) -> None:
                loop.call_soon_threadsafe(progress.stage, p.stage)

            try:
                image = await self.builder.build_async(recipe, progress=on_progress)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.svc.metrics.image_build.labels("failed", "false").observe(
                    loop.time() - started
                )
                raise OperationFailed(getattr(exc, "stage", None) or "build", str(exc)) from None
            seconds = loop.time() - started
            self.svc.metrics.image_build.labels("ok", str(image.cached).lower()).observe(seconds)
            await self.record_image(image, owner)
            self.svc.events.publish(
                "image.built",
                actor=actor,
                data={"image": image.name, "cached": image.cached, "seconds": round(seconds, 3)},
            )
            return {"image": image.name, "cached": image.cached, "seconds": round(seconds, 3)}

        return await self.ops.submit(
            kind="image-build",
            subject_type="image",
            subject_id=name,
            owner=owner,
            actor=actor,
            body=body,
        )

    async def record_image(self, image: Any, owner: str) -> None:
        async with self.svc.db.session() as sess:
            row = await sess.get(m.Image, image.name)
            if row is None:
                row = m.Image(name=image.name, owner=owner)
                sess.add(row)
            row.recipe = image.manifest.recipe_name
            row.kind = image.kind
            row.content_hash = image.manifest.content_hash
            row.path = str(image.path)
            row.size_bytes = image.manifest.disk.actual_size
            row.state = "ready"
            row.manifest = image.manifest.model_dump(mode="json")

    def work_dir(self) -> Path:
        return self.svc.settings.data_dir / "provision"
