"""The fleet's services in process, on libvirt's test driver: create, act, snapshot, clone,
delete and the domain errors, called as the admin routes call them (no HTTP in between), so a
failure points at the service rather than at the wire. The HTTP surface over the same
services is `test_instances_api.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentic_sandbox.broker.auth.principal import Principal, Role
from agentic_sandbox.broker.incarnations import EndedIncarnation
from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.broker.instances.errors import (
    ConflictError,
    FleetUnavailable,
    InvalidInput,
    NotFoundError,
    QuotaExceeded,
)
from agentic_sandbox.broker.instances.service import Action, InstanceFilter, NewInstance
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.fleet import InvalidRequest
from agentic_sandbox.images import ImageStore
from tests.integration.instances.conftest import IMAGE
from tests.support.fake_images import publish_fake
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import node_uri

ADMIN = Principal(subject="admin", role=Role.admin, kind="token", credential_id="t-admin")
ALICE = Principal(subject="alice", role=Role.operator, kind="token", credential_id="t-alice")
BOB = Principal(subject="bob", role=Role.operator, kind="token", credential_id="t-bob")


@dataclass
class Fleet:
    r: Running
    comp: FleetComponent
    ended: list[EndedIncarnation]

    async def create(self, who: Principal, new: NewInstance) -> m.Operation:
        op = await self.comp.instances.create(who, new)
        await self.comp.ops.wait(op.id)
        done = await self.comp.operations.get(who, op.id)
        assert done.state in ("succeeded", "failed"), done.state
        return done


async def _fleet(tmp_path: Path, **settings: object) -> AsyncIterator[Fleet]:
    publish_fake(ImageStore(tmp_path / "data" / "images"), IMAGE, recipe_name="fake")
    uri = node_uri(tmp_path, "local") if settings.pop("libvirt", True) else ""
    config = make_settings(tmp_path, libvirt_uri=uri, kvm_probe=False, **settings)
    async with start_server(config, components=lambda svc: [FleetComponent(svc)]) as r:
        comp = next(c for c in r.server.components if isinstance(c, FleetComponent))
        ended: list[EndedIncarnation] = []

        async def record(e: EndedIncarnation) -> None:
            ended.append(e)

        r.svc.incarnations.on_end("test", record)
        yield Fleet(r, comp, ended)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async for f in _fleet(tmp_path):
        yield f


def vm(instance_id: str, **kw: object) -> NewInstance:
    return NewInstance(id=instance_id, image=IMAGE, wait_ready=False, **kw)


async def test_create_act_and_delete_end_the_incarnation(fleet: Fleet) -> None:
    instances = fleet.comp.instances
    op = await fleet.create(ALICE, vm("svc-1"))
    assert op.state == "succeeded", op.error
    row = await instances.get(ALICE, "svc-1")
    assert (row.state, row.owner, row.host) == ("running", "alice", "local")
    for action, state in (
        (Action.SUSPEND, "paused"),
        (Action.RESUME, "running"),
        (Action.STOP, "shutoff"),
        (Action.START, "running"),
        (Action.FORCE_OFF, "shutoff"),
    ):
        assert (await instances.act(ALICE, "svc-1", action, grace_s=0)).state == state, action
    with pytest.raises(InvalidRequest):  # the fleet's own error passes through, typed
        await instances.act(ALICE, "svc-1", Action.RESTART)
    with pytest.raises(NotFoundError):  # bob sees nothing of alice's
        await instances.act(BOB, "svc-1", Action.START)
    assert [i.id for i in await instances.list_instances(BOB, InstanceFilter())] == []
    assert [i.id for i in await instances.list_instances(ADMIN, InstanceFilter())] == ["svc-1"]

    await instances.delete(ALICE, "svc-1")
    with pytest.raises(NotFoundError):
        await instances.get(ALICE, "svc-1")
    assert [(e.instance_id, e.incarnation) for e in fleet.ended] == [("svc-1", row.incarnation)]


async def test_create_refuses_what_cannot_work_before_recording_anything(fleet: Fleet) -> None:
    instances = fleet.comp.instances
    cases: list[tuple[NewInstance, str]] = [
        (vm("e-1", loadout="nope"), "loadout"),
        (vm("e-1", loadout_spec={"name": "x", "extends": "nope"}), "loadout_spec.extends"),
        (NewInstance(id="e-1", image="no-such-image"), "image"),
        (NewInstance(id="e-1", image=IMAGE, from_pool=True), "from_pool"),
    ]
    for new, field in cases:
        with pytest.raises(InvalidInput) as err:
            await instances.create(ADMIN, new)
        assert err.value.field == field, (new, err.value)
    with pytest.raises(InvalidInput) as err:
        await instances.create(ADMIN, NewInstance(id="e-1", image="debian-12-agent"))
    assert err.value.code == "image-not-built" and err.value.extra == {"recipe": "debian-12-agent"}
    with pytest.raises(NotFoundError):
        await instances.create(ADMIN, NewInstance(id="e-1", from_snapshot="nobody/s1"))
    assert await instances.list_instances(ADMIN, InstanceFilter()) == []
    assert fleet.ended == []

    assert (await fleet.create(ADMIN, vm("e-2"))).state == "succeeded"
    with pytest.raises(ConflictError) as conflict:
        await instances.create(ADMIN, vm("e-2"))
    assert conflict.value.code == "instance-exists"


async def test_the_instance_quota_is_per_owner(tmp_path: Path) -> None:
    async for fleet in _fleet(tmp_path, max_instances_per_owner=1):
        assert (await fleet.create(ALICE, vm("q-1"))).state == "succeeded"
        with pytest.raises(QuotaExceeded) as err:
            await fleet.comp.instances.create(ALICE, vm("q-2"))
        assert err.value.retry_after == 60 and "limit 1" in err.value.message
        assert (await fleet.create(BOB, vm("q-3"))).state == "succeeded"


async def test_a_failed_provision_is_abandoned(fleet: Fleet) -> None:
    """Nothing is left of it: no record, and its incarnation ended."""
    # a host that does not exist: the fleet refuses at placing, after the record was made
    op = await fleet.create(ADMIN, vm("fail-1", host="elsewhere"))
    assert op.state == "failed" and op.error is not None and op.error["stage"] == "placing"
    with pytest.raises(NotFoundError):
        await fleet.comp.instances.get(ADMIN, "fail-1")
    async with fleet.r.svc.db.session() as s:
        assert await s.get(m.Instance, "fail-1") is None
    assert [e.instance_id for e in fleet.ended] == ["fail-1"]
    assert fleet.ended[0].reason.startswith("provision failed: placing: ")


async def test_a_first_boot_that_needs_nat_is_refused_before_anything_is_made(
    fleet: Fleet,
) -> None:
    """The dev loadout installs packages at first boot; on a restricted network that cannot
    work, and the request says so: a refusal naming `network`, no record, no incarnation."""
    for network in ("isolated", "allowlist"):
        with pytest.raises(InvalidInput) as err:
            await fleet.comp.instances.create(ADMIN, vm("nat-1", loadout="dev", network=network))
        assert err.value.field == "network" and "needs network 'nat'" in err.value.detail
        assert repr(network) in err.value.detail
    async with fleet.r.svc.db.session() as s:
        assert await s.get(m.Instance, "nat-1") is None
    assert fleet.ended == []
    assert (await fleet.create(ADMIN, vm("nat-1", loadout="dev", network="nat"))).state == (
        "succeeded"
    )


async def test_an_interrupted_provision_is_cleaned_up_at_start(fleet: Fleet) -> None:
    """A row left `provisioning` by a server that stopped mid-provision: its half-made VM and
    record go, its incarnation ends, and the seeds left behind are removed."""
    assert (await fleet.create(ADMIN, vm("half-1"))).state == "succeeded"
    async with fleet.r.svc.db.session() as s:
        row = await s.get(m.Instance, "half-1")
        assert row is not None
        row.state = "provisioning"
        incarnation = row.incarnation
    seed = fleet.comp.provisioning.work_dir / "seeds" / "half-1.iso"
    seed.write_bytes(b"left behind")
    await fleet.comp.provisioning.recover_interrupted()
    async with fleet.r.svc.db.session() as s:
        assert await s.get(m.Instance, "half-1") is None
    assert [(e.instance_id, e.incarnation) for e in fleet.ended] == [("half-1", incarnation)]
    assert "half-1" not in {i.instance_id for i in await fleet.comp.fleet.list_instances()}
    assert not seed.exists()


async def test_snapshots_clone_and_delete_leave_no_state(fleet: Fleet) -> None:
    comp = fleet.comp
    assert (await fleet.create(ALICE, vm("snap-src"))).state == "succeeded"
    memory = await comp.snapshots.create(
        ALICE, "snap-src", name="s1", memory=True, description="with memory"
    )
    assert memory.kind == "memory" and memory.detail["state_id"] == "snap-src--s1"
    with pytest.raises(ConflictError):
        await comp.snapshots.create(ALICE, "snap-src", name="s1", memory=True, description="")
    op = await comp.instances.clone(ALICE, "snap-src", new_id="snap-copy", snapshot="s1")
    await comp.ops.wait(op.id)
    assert (await comp.operations.get(ALICE, op.id)).state == "succeeded"
    copy = await comp.instances.get(ALICE, "snap-copy")
    assert copy.loadout == "minimal" and copy.state == "running"
    assert (await comp.snapshots.revert(ALICE, "snap-src", "s1")).state == "running"

    await comp.instances.act(ALICE, "snap-src", Action.FORCE_OFF)
    await comp.snapshots.create(ALICE, "snap-src", name="d1", memory=False, description="")
    with pytest.raises(InvalidInput) as err:  # a disk-only snapshot has no memory to restore
        await comp.instances.clone(ALICE, "snap-src", new_id="snap-2", snapshot="d1")
    assert err.value.field == "from_snapshot"
    assert [s.name for s in await comp.snapshots.of_instance(ALICE, "snap-src")] == ["s1", "d1"]
    await comp.snapshots.delete(ALICE, "snap-src", "d1")

    await comp.instances.delete(ALICE, "snap-src")  # its snapshot's state goes through the fleet
    assert "snap-src--s1" not in {st.state_id for st in await comp.fleet.list_states()}
    assert await comp.snapshots.rows("snap-src") == []
    await comp.instances.delete(ALICE, "snap-copy")  # the frozen disk goes with the last clone
    assert await comp.fleet.list_states() == []


async def test_act_refuses_a_provisioning_instance(fleet: Fleet) -> None:
    assert (await fleet.create(ADMIN, vm("busy-1"))).state == "succeeded"
    async with fleet.r.svc.db.session() as s:
        row = await s.get(m.Instance, "busy-1")
        assert row is not None
        row.state = "provisioning"
    with pytest.raises(ConflictError, match="still being provisioned"):
        await fleet.comp.instances.act(ADMIN, "busy-1", Action.SUSPEND)


async def test_pools_and_hosts_errors(fleet: Fleet) -> None:
    with pytest.raises(NotFoundError):
        await fleet.comp.pools.remove(ADMIN, "pool-nothing")
    assert await fleet.comp.pools.views() == []
    with pytest.raises(ConflictError):
        await fleet.comp.hosts.remove(ADMIN, "local")
    assert [h.spec.name for h in await fleet.comp.hosts.list_hosts()] == ["local"]


async def test_without_libvirt_the_fleet_is_unavailable(tmp_path: Path) -> None:
    async for fleet in _fleet(tmp_path, libvirt=False):
        with pytest.raises(FleetUnavailable) as err:
            await fleet.comp.instances.create(ADMIN, vm("off-1"))
        assert err.value.retry_after == 60
        with pytest.raises(FleetUnavailable):
            await fleet.comp.hosts.list_hosts()
        assert await fleet.comp.instances.list_instances(ADMIN, InstanceFilter()) == []
        assert [i.name for i in fleet.comp.images.available()] == [IMAGE]
