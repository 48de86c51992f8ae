"""Provisions as operations: the pipeline run in the background, its outcome recorded.

A provision that does not end ready leaves nothing: the pipeline deletes what it made, and
`abandon` removes the instance's record and ends its incarnation (its one-time token and any
certificate revoked, a link that came up closed, whatever was bound to it meanwhile dropped) —
after a failure, a cancel, or a server restart that interrupted it (`recover_interrupted`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

from sqlalchemy import select

from agentic_sandbox.broker.cluster import interruption
from agentic_sandbox.broker.instances.access import FleetGate
from agentic_sandbox.broker.instances.mirror import apply_record
from agentic_sandbox.broker.operations import OperationFailed, OperationRunner, Progress
from agentic_sandbox.broker.services import Services
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import Fleet, Instance
from agentic_sandbox.provision import (
    STAGES,
    Enroller,
    Provisioner,
    ProvisionError,
    ProvisionRequest,
    StageRecord,
)
from agentic_sandbox.provision.ssh import diagnose as ssh_diagnose
from agentic_sandbox.provision.ssh import ensure_key

log = logging.getLogger(__name__)


class Provisioning:
    def __init__(self, svc: Services, fleet: Fleet, gate: FleetGate, ops: OperationRunner) -> None:
        self._svc = svc
        self._fleet = fleet
        self._gate = gate
        self._ops = ops
        settings = svc.settings
        self.provisioner = Provisioner(
            fleet,
            settings.data_dir / "provision",
            agent_port=settings.guest_link_address[1],
            diagnose=self._diagnose,
        )
        self.enroller: Enroller | None = None  # set at start: the agent link is up by then
        self.ssh_key_path = settings.data_dir / "ssh" / "id_ed25519"
        self.ssh_public_key = ""
        self._slots = asyncio.Semaphore(settings.max_concurrent_provisions)

    @property
    def work_dir(self) -> Path:
        return self.provisioner.work_dir

    async def ensure_ssh_key(self) -> None:
        """The server's own SSH key, given to every guest for diagnosis over its forward."""
        self.ssh_public_key = await asyncio.to_thread(ensure_key, self.ssh_key_path)

    async def _diagnose(self, inst: Instance) -> str:
        port = inst.record.ssh_port
        if not port or not self.ssh_key_path.exists():
            return "no SSH forward to diagnose through"
        return await ssh_diagnose(port, self.ssh_key_path)

    # ---- running one --------------------------------------------------------------------------
    async def submit(self, req: ProvisionRequest, *, actor: str, source_label: str) -> m.Operation:
        """Start the provision as an operation (at most `max_concurrent_provisions` run at
        once; the rest wait their turn)."""
        if self.ssh_public_key and self.ssh_public_key not in req.ssh_keys:
            # the server's own key, for diagnosis over the instance's loopback SSH forward
            req = dataclasses.replace(req, ssh_keys=(*req.ssh_keys, self.ssh_public_key))

        async def body(progress: Progress) -> dict[str, object]:
            async with self._slots:
                return await self._run(req, progress, actor, source_label)

        return await self._ops.submit(
            kind="provision",
            subject_type="instance",
            subject_id=req.instance_id,
            owner=req.owner,
            actor=actor,
            body=body,
            planned=STAGES,
        )

    async def _run(
        self, req: ProvisionRequest, progress: Progress, actor: str, source_label: str
    ) -> dict[str, object]:
        def on_stage(name: str, records: list[StageRecord]) -> None:
            progress.stage(name, [r.as_dict(records[0].started) for r in records])

        try:
            result = await self.provisioner.provision(req, self.enroller, on_stage)
        except asyncio.CancelledError:
            await asyncio.shield(self.abandon(req.instance_id, req.incarnation, actor, "canceled"))
            raise
        except ProvisionError as exc:
            progress.stages = exc.stages or progress.stages
            await self._failed(req, exc, actor, source_label)
            detail = {"diagnostics": exc.diagnostics[-8000:]} if exc.diagnostics else {}
            raise OperationFailed(exc.stage, exc.cause, detail) from None
        progress.stages = result.stages
        metrics = self._svc.metrics
        for stage in result.stages:
            if stage["seconds"] is not None:
                metrics.provision_stage.labels(stage["name"], "ok").observe(stage["seconds"])
        metrics.provisions.labels(source_label, "succeeded").inc()
        inst = result.instance
        async with self._svc.db.session() as s:
            row = await s.get(m.Instance, req.instance_id)
            if row is not None:
                apply_record(row, inst.record, inst.state.value, "provisioned")
                row.agent_state = (
                    "connected" if req.wait_ready and self.enroller else row.agent_state
                )
        self._svc.audit.transition(
            actor,
            "instance",
            req.instance_id,
            "provisioning",
            inst.state.value,
            cause=f"provisioned from {source_label} in {result.seconds:.1f}s",
        )
        outcome: dict[str, object] = {
            "source": source_label,
            "seconds": round(result.seconds, 3),
            "stages": result.stages,
        }
        self._svc.events.publish(
            "instance.ready",
            actor=actor,
            owner=req.owner,
            instance_id=req.instance_id,
            host=inst.host,
            data=dict(outcome),
        )
        return {"instance_id": req.instance_id, "host": inst.host, **outcome}

    async def _failed(
        self, req: ProvisionRequest, exc: ProvisionError, actor: str, source_label: str
    ) -> None:
        cause = f"{exc.stage}: {exc.cause}"
        self._svc.metrics.provisions.labels(source_label, "failed").inc()
        await self.abandon(req.instance_id, req.incarnation, actor, cause)
        self._svc.audit.record(
            actor, "instance.provision", "instance", req.instance_id, outcome="failed", cause=cause
        )
        self._svc.events.publish(
            "instance.provision_failed",
            actor=actor,
            owner=req.owner,
            instance_id=req.instance_id,
            data={"stage": exc.stage, "cause": exc.cause},
        )

    # ---- what is left of one that did not end ready -------------------------------------------
    async def abandon(self, instance_id: str, incarnation: str, actor: str, reason: str) -> None:
        """Nothing is left of a failed, canceled or abandoned provision: its record goes and its
        incarnation ends (tokens and certificates revoked, a link that came up closed, anything
        bound to it meanwhile dropped)."""
        async with self._svc.db.session() as s:
            row = await s.get(m.Instance, instance_id)
            if row is not None and row.incarnation == incarnation:
                await s.delete(row)
        if incarnation:
            await self._svc.incarnations.end(
                instance_id, incarnation, actor=actor, reason=f"provision failed: {reason}"
            )

    async def recover_interrupted(self) -> None:
        """Provisions the server was running when it stopped (a kill -9, a crash) cannot be
        resumed: each is abandoned as a failed one would be — its half-made VM deleted, its
        record removed, its incarnation ended (the token in its seed no longer enrolls) — and
        the seeds left behind are removed."""
        async with self._svc.db.session() as s:
            rows = (
                await s.scalars(
                    select(m.Instance).where(
                        m.Instance.state == "provisioning", m.Instance.deleted_at.is_(None)
                    )
                )
            ).all()
            interrupted = [(r.id, r.incarnation) for r in rows]
        why = interruption(self._svc.cluster)
        for instance_id, incarnation in interrupted:
            log.warning(
                "provision of %s was interrupted (%s); cleaning it up",
                instance_id,
                why,
                extra={"instance_id": instance_id},
            )
            if self._gate.opened:
                try:
                    await self._fleet.delete(instance_id)
                except Exception:
                    log.exception("deleting the half-made %s failed", instance_id)
            await self.abandon(instance_id, incarnation, "server", why)
            self._svc.events.publish(
                "instance.provision_failed",
                actor="server",
                instance_id=instance_id,
                data={"stage": "unknown", "cause": f"{why}, during provisioning"},
            )
        seeds = self.work_dir / "seeds"
        for stale in seeds.glob("*.iso*") if seeds.is_dir() else ():
            stale.unlink(missing_ok=True)
