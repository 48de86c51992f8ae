"""Warm pools: per image + loadout + network, N restored-and-paused VMs ready to hand out.

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
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from agentic_sandbox.broker.operations import OperationFailed, Progress
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import EgressPolicy, FleetError
from agentic_sandbox.provision import ProvisionError, ProvisionRequest

if TYPE_CHECKING:
    from agentic_sandbox.broker.instances.component import FleetComponent

log = logging.getLogger(__name__)

KV_PREFIX = "pool:"
DONE_MARKER = b"agentic-sandbox: stage cloud-init-done"


def pool_key(image: str, loadout: str, network: str) -> str:
    """A fleet-safe name for (image, loadout, network)."""
    digest = hashlib.sha256(f"{image}\0{loadout}\0{network}".encode()).hexdigest()[:10]
    return f"pool-{digest}"


async def saved_pools(comp: FleetComponent) -> list[dict[str, Any]]:
    async with comp.svc.db.session() as s:
        rows = (
            await s.scalars(select(m.KeyValue).where(m.KeyValue.key.startswith(KV_PREFIX)))
        ).all()
    return [dict(r.value) for r in rows]


async def restore_pools(comp: FleetComponent) -> None:
    """At start: configure the pools that were prepared before (their members are re-adopted)."""
    states = {s.state_id for s in await comp.fleet.list_states()}
    for pool in await saved_pools(comp):
        if pool.get("state_id") not in states:
            log.warning("warm pool %s lost its saved state; prepare it again", pool.get("key"))
            continue
        try:
            await comp.fleet.configure_pool(
                pool["key"],
                pool["state_id"],
                int(pool["size"]),
                egress=EgressPolicy(pool["network"]),
                agent_port=comp.svc.settings.guest_link_address[1],
            )
        except FleetError as exc:
            log.error("warm pool %s: %s", pool["key"], exc)


async def prepare(
    comp: FleetComponent,
    progress: Progress,
    *,
    image: Any,
    loadout: Any,
    network: EgressPolicy,
    size: int,
) -> dict[str, Any]:
    key = pool_key(image.name, loadout.name, network.value)
    # a name of this preparation's own: servers sharing a libvirtd prepare the same pool keys
    golden = f"golden-{key.removeprefix('pool-')}-{secrets.token_hex(3)}"
    state_id = f"{key}-{image.name[-12:]}"
    settings = comp.svc.settings
    states = {s.state_id for s in await comp.fleet.list_states()}
    if state_id not in states:
        progress.stage("golden")
        req = ProvisionRequest(
            instance_id=golden,
            owner="system",
            loadout=loadout,
            source="image",
            image=image,
            network=network,
            ssh_keys=(comp.ssh_public_key,) if comp.ssh_public_key else (),
            wait_ready=False,
        )
        try:
            await comp.provisioner.provision(req, None)
            progress.stage("settling")
            limit = settings.provision_ready_timeout_seconds
            try:
                await _wait_marker(comp, golden, limit)
            except TimeoutError:
                tail = (await comp.fleet.read_serial_log(golden))[-4000:]
                raise OperationFailed(
                    "settling",
                    f"the golden VM's cloud-init did not finish within {limit:.0f}s",
                    {"diagnostics": "serial console (tail):\n" + tail.decode("utf-8", "replace")},
                ) from None
            await asyncio.sleep(2.0)  # let the agent start and settle into waiting
            progress.stage("saving")
            await comp.fleet.capture_state(golden, state_id)
        except (ProvisionError, FleetError, TimeoutError) as exc:
            stage = getattr(exc, "stage", None) or "golden"
            raise OperationFailed(str(stage), str(getattr(exc, "cause", exc))) from None
        finally:
            try:
                await comp.fleet.delete(golden)
            except FleetError:
                log.exception("deleting golden %s failed", golden)
    progress.stage("filling")
    await comp.fleet.configure_pool(
        key, state_id, size, egress=network, agent_port=settings.guest_link_address[1]
    )
    record = {
        "key": key,
        "image": image.name,
        "loadout": loadout.name,
        "network": network.value,
        "size": size,
        "state_id": state_id,
    }
    async with comp.svc.db.session() as s:
        row = await s.get(m.KeyValue, KV_PREFIX + key)
        if row is None:
            s.add(m.KeyValue(key=KV_PREFIX + key, value=record))
        else:
            row.value = record
    return record


async def _wait_marker(comp: FleetComponent, instance_id: str, limit: float) -> None:
    async with asyncio.timeout(limit):
        while True:
            log_bytes = await comp.fleet.read_serial_log(instance_id)
            if DONE_MARKER in log_bytes:
                return
            await asyncio.sleep(1.0)


async def remove(comp: FleetComponent, key: str) -> bool:
    pools = {p["key"]: p for p in await saved_pools(comp)}
    pool = pools.get(key)
    if pool is None:
        return False
    # Its members go; instances taken from it keep running on the golden state's frozen disk,
    # which the fleet removes with the last of them (the memory image goes now). A failure
    # keeps the pool's row, so the removal can be retried.
    await comp.fleet.remove_pool(key)
    await comp.fleet.delete_state(pool["state_id"])
    async with comp.svc.db.session() as s:
        row = await s.get(m.KeyValue, KV_PREFIX + key)
        if row is not None:
            await s.delete(row)
    return True
