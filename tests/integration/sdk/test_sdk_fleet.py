"""The SDK over a fleet on libvirt's test driver: a create's operation followed with
progress, a failed one as `OperationFailed` naming its stage, lifecycle, snapshots and
revert, clones, operations, warm pools, images, hosts and loadouts.

No agent runs in these VMs (the test driver boots nothing), so creates do not wait for one;
`wait_ready` is shown to follow the operation, then to wait for an agent that never comes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox import AsyncClient, Client
from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.images import ImageStore
from agentic_sandbox.sdk import (
    Conflict,
    NotFound,
    Operation,
    OperationFailed,
    Unavailable,
    ValidationFailed,
)
from tests.support.fake_images import publish_fake
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import golden_console_says_done, node_uri

IMAGE = "fake-0123456789ab"


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[Running, AsyncClient]]:
    publish_fake(ImageStore(tmp_path / "data" / "images"), IMAGE, recipe_name="fake")
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        golden_console_says_done(
            next(c for c in r.server.components if isinstance(c, FleetComponent))
        )
        async with AsyncClient(r.url, r.admin_token) as client:
            yield r, client


async def test_create_follow_lifecycle_delete(fleet: tuple[Running, AsyncClient]) -> None:
    _, sbx = fleet
    seen: list[Operation] = []
    op = await sbx.instances.create("sdk-vm", image=IMAGE, memory_mib=512, wait_ready=False)
    assert op.kind == "provision" and op.subject_id == "sdk-vm" and not op.done
    done = await sbx.operations.wait(op, progress=seen.append)
    assert done.state == "succeeded" and [s["name"] for s in done.stages][-1] == "ready"
    stages = [o.stage for o in seen]
    assert stages == sorted(set(stages), key=stages.index), stages  # each reported once
    assert seen[-1].state == "succeeded"
    assert [o.id for o in await sbx.operations.list(subject_id="sdk-vm")] == [op.id]
    inst = await sbx.instances.get("sdk-vm")
    assert inst.state == "running" and inst.memory_mib == 512 and not inst.ready
    with pytest.raises(TimeoutError, match="agent"):  # no agent ever enrolls here
        await sbx.instances.wait_ready(op, timeout=1)
    for action, state in (
        (sbx.instances.suspend, "paused"),
        (sbx.instances.resume, "running"),
        (sbx.instances.force_off, "shutoff"),
        (sbx.instances.start, "running"),
        (sbx.instances.restart, "running"),
    ):
        assert (await action("sdk-vm")).state == state, action
    assert (await sbx.instances.stop("sdk-vm", grace_seconds=1)).state == "shutoff"
    assert isinstance((await sbx.instances.console("sdk-vm", tail=10)).text, str)
    await sbx.instances.delete("sdk-vm")
    with pytest.raises(NotFound):
        await sbx.instances.get("sdk-vm")


async def test_a_failed_create_names_its_stage(fleet: tuple[Running, AsyncClient]) -> None:
    _, sbx = fleet
    op = await sbx.instances.create("sdk-big", image=IMAGE, memory_mib=262144, wait_ready=False)
    with pytest.raises(OperationFailed) as exc:
        await sbx.instances.wait_ready(op)
    assert exc.value.stage == "placing" and "MiB" in exc.value.cause
    assert exc.value.operation.state == "failed"
    assert str(exc.value).startswith("provision sdk-big failed at stage placing: ")


async def test_snapshots_revert_and_clone(fleet: tuple[Running, AsyncClient]) -> None:
    _, sbx = fleet
    await sbx.operations.wait(
        await sbx.instances.create("sdk-src", image=IMAGE, memory_mib=256, wait_ready=False)
    )
    snap = await sbx.snapshots.create("sdk-src", "s1", memory=True, description="before")
    assert snap.name == "s1" and snap.kind == "memory"
    assert [s.name for s in await sbx.snapshots.list("sdk-src")] == ["s1"]
    assert (await sbx.snapshots.revert("sdk-src", "s1")).state == "running"
    clone = await sbx.instances.clone("sdk-src", "sdk-copy", snapshot="s1", wait_ready=False)
    assert (await sbx.operations.wait(clone)).state == "succeeded"
    assert (await sbx.instances.get("sdk-copy")).state == "running"
    await sbx.instances.delete("sdk-copy")
    await sbx.snapshots.delete("sdk-src", "s1")
    assert await sbx.snapshots.list("sdk-src") == []
    with pytest.raises(NotFound):
        await sbx.snapshots.revert("sdk-src", "s1")


async def test_pools_images_hosts_loadouts(
    fleet: tuple[Running, AsyncClient], tmp_path: Path
) -> None:
    _, sbx = fleet
    op = await sbx.operations.wait(await sbx.pools.create(image=IMAGE, size=1))
    assert op.kind == "pool-prepare" and op.result and op.result["size"] == 1
    deadline = time.monotonic() + 60
    while (pool := (await sbx.pools.list())[0]).ready < 1:  # the fleet fills it after
        assert time.monotonic() < deadline, pool
        await asyncio.sleep(0.1)
    assert (pool.key, pool.image, pool.size, pool.ready) == (op.subject_id, IMAGE, 1, 1)
    await sbx.pools.delete(pool.key)
    assert await sbx.pools.list() == []
    assert IMAGE in {i.name for i in await sbx.images.list()}
    host = await sbx.hosts.add("second", node_uri(tmp_path, "second"), labels={"zone": "b"})
    assert host.name == "second" and host.labels == {"zone": "b"}
    assert {h.name for h in await sbx.hosts.list()} == {"local", "second"}
    assert (await sbx.hosts.get("second")).uri == host.uri
    await sbx.hosts.remove("second")
    loadouts = {lo.name: lo for lo in await sbx.loadouts.list()}
    assert "minimal" in loadouts
    assert (await sbx.loadouts.get("minimal")).network == loadouts["minimal"].network
    with pytest.raises(NotFound):
        await sbx.loadouts.get("no-such-loadout")


async def test_cancel_an_operation(fleet: tuple[Running, AsyncClient]) -> None:
    r, sbx = fleet
    comp = next(c for c in r.server.components if isinstance(c, FleetComponent))

    async def console_never_done(instance_id: str, offset: int = 0) -> bytes:
        return b""

    # this golden's console never says done: it settles until canceled
    comp.fleet.read_serial_log = console_never_done  # type: ignore[method-assign]
    op = await sbx.pools.create(image=IMAGE, size=1)
    deadline = time.monotonic() + 60
    while (op := await sbx.operations.get(op)).stage != "settling":
        assert time.monotonic() < deadline and not op.done, op
        await asyncio.sleep(0.05)
    await sbx.operations.cancel(op.id)
    final = await sbx.operations.wait(op, check=False)
    assert final.state == "canceled", final
    with pytest.raises(OperationFailed, match="was canceled"):
        await sbx.operations.wait(final)
    assert await sbx.pools.list() == []


async def test_without_a_fleet_the_admin_api_says_unavailable(tmp_path: Path) -> None:
    async with (
        start_server(make_settings(tmp_path), lambda svc: [FleetComponent(svc)]) as r,
        AsyncClient(r.url, r.admin_token) as sbx,
    ):
        with pytest.raises(Unavailable) as exc:
            await sbx.instances.create("vm-x")
        assert exc.value.status == 503 and "disabled" in str(exc.value)
        assert exc.value.retry_after == 60


async def test_versioned_loadouts_async_and_blocking(fleet: tuple[Running, AsyncClient]) -> None:
    r, sbx = fleet
    spec = {"name": "sdk-web", "extends": "minimal", "description": "v1"}
    first = await sbx.loadouts.apply(spec)
    assert (first.name, first.version, first.created, first.active) == ("sdk-web", 1, True, True)
    assert first.extends is not None and (first.extends.name, first.extends.version) == (
        "minimal",
        1,
    )
    again = await sbx.loadouts.apply(dict(reversed(list(spec.items()))))
    assert (again.version, again.digest, again.created) == (1, first.digest, False)

    def blocking() -> tuple[int, int, int]:
        with Client(r.url, r.admin_token) as c:
            second = c.loadouts.apply({**spec, "description": "v2"})
            listed = c.loadouts.versions("sdk-web")
            moved = c.loadouts.activate("sdk-web", 2, expected_version=1)
            return second.version, len(listed.items), moved.active_version

    assert await asyncio.to_thread(blocking) == (2, 2, 2)
    with pytest.raises(Conflict) as err:
        await sbx.loadouts.activate("sdk-web", 1, expected_version=1)
    assert err.value.problem["active_version"] == 2
    active = await sbx.loadouts.get("sdk-web")
    assert (active.version, active.description) == (2, "v2")
    old = await sbx.loadouts.get("sdk-web", 1)
    assert (old.version, old.spec["description"], old.active) == (1, "v1", False)
    with pytest.raises(ValidationFailed) as bad:
        await sbx.loadouts.apply({"name": "sdk-bad", "resources": {"cpus": 0}})
    assert list(bad.value.fields) == ["body.spec.resources.cpus"], bad.value
    op = await sbx.instances.create(
        "sdk-lv", image=IMAGE, loadout="sdk-web", loadout_version=1, wait_ready=False
    )
    await sbx.operations.wait(op)
    inst = await sbx.instances.get("sdk-lv")
    assert (inst.loadout, inst.loadout_version, inst.loadout_digest) == ("sdk-web", 1, first.digest)
