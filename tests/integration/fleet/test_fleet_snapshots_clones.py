"""Snapshots, saved states, clones and the warm pool on the test driver."""

from __future__ import annotations

import pytest
from fleet_support.fleet_env import Env
from fleet_support.testdriver import wait_for

from agentic_sandbox.fleet import (
    CloneSpec,
    Conflict,
    InstanceSpec,
    InstanceState,
    InvalidRequest,
    NotFound,
)
from agentic_sandbox.fleet.domain_xml import parse_record


async def test_snapshot_create_list_revert_delete(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="a1", image="img"))
    s = await f.create_snapshot("a1", "s1", description="first")
    assert s.with_memory and s.name == "s1" and s.description == "first"
    again = await f.create_snapshot("a1", "s1")  # idempotent
    assert again.name == "s1"
    with pytest.raises(InvalidRequest):
        await f.create_snapshot("a1", "disk", with_memory=False)  # running: memory only
    await f.create_snapshot("a1", "s2")
    assert [x.name for x in await f.list_snapshots("a1")] == ["s1", "s2"]
    await f.force_off("a1")
    d = await f.create_snapshot("a1", "off")
    assert not d.with_memory
    reverted = await f.revert_snapshot("a1", "s1")
    assert reverted.state is InstanceState.RUNNING
    assert (await f.revert_snapshot("a1", "s2", paused=True)).state is InstanceState.PAUSED
    with pytest.raises(NotFound):
        await f.revert_snapshot("a1", "nope")
    await f.delete_snapshot("a1", "s2")
    await f.delete_snapshot("a1", "s2")  # idempotent
    assert [x.name for x in await f.list_snapshots("a1")] == ["off", "s1"]
    assert "snapshot.reverted" in env.kinds("a1")
    await f.delete("a1")  # with its snapshots
    assert env.domains() == []


async def test_capture_and_clone_under_new_identities(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="gold", image="img", loadout="py"))
    st = await f.capture_state("gold", "py-v1")
    assert st.image == "img" and st.loadout == "py"
    assert (await f.get("gold")).state is InstanceState.SHUTOFF
    with pytest.raises(Conflict):
        await f.capture_state("gold", "py-v1")
    c1 = await f.clone_from_state("py-v1", CloneSpec(instance_id="c1", owner="alice"))
    c2 = await f.clone_from_state("py-v1", CloneSpec(instance_id="c2"), paused=True)
    assert c1.state is InstanceState.RUNNING and c2.state is InstanceState.PAUSED
    assert len({c1.record.domain, c2.record.domain, "sbx-gold"}) == 3
    assert c1.record.ssh_port != c2.record.ssh_port
    assert c1.record.overlay != c2.record.overlay
    assert c1.record.origin == "state:py-v1"
    conn = f.hosts["h1"].conn
    assert conn is not None
    d1 = conn.lookupByName("sbx-c1")
    assert d1.UUIDString() != conn.lookupByName("sbx-c2").UUIDString()
    rec = parse_record(d1.XMLDesc(0))
    assert rec is not None and rec.instance_id == "c1" and rec.owner == "alice"
    with pytest.raises(Conflict):
        await f.delete_state("py-v1")  # clones still use it
    for iid in ("c1", "c2", "gold"):
        await f.delete(iid)
    await f.delete_state("py-v1")
    assert await f.list_states() == []
    assert sorted((env.data / "states").iterdir()) == []


async def test_clone_from_snapshot_needs_local_files(env: Env) -> None:
    await env.fleet.create(InstanceSpec(instance_id="a1", image="img"))
    await env.fleet.create_snapshot("a1", "s1")
    with pytest.raises(InvalidRequest):
        await env.fleet.clone_from_snapshot("a1", "s1", CloneSpec(instance_id="b1"))
    assert "b1" not in env.fleet.entries


async def test_warm_pool_take_and_refill(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="gold", image="img"))
    await f.capture_state("gold", "st")
    status = await f.configure_pool("img-default", "st", 2, wait=True)
    assert status.ready == 2
    pooled = await f.list_instances(include_pooled=True)
    assert len([i for i in pooled if i.record.pool == "img-default"]) == 2
    assert all(i.state is InstanceState.PAUSED for i in pooled if i.record.pool)
    assert [i.instance_id for i in await f.list_instances()] == ["gold"]

    got = await f.take_from_pool("img-default", CloneSpec(instance_id="fast-1", owner="bob"))
    assert got is not None and got.state is InstanceState.RUNNING
    assert got.record.pool is None and got.record.owner == "bob"
    conn = f.hosts["h1"].conn
    assert conn is not None
    rec = parse_record(conn.lookupByName(got.record.domain).XMLDesc(0))
    assert rec is not None and rec.instance_id == "fast-1" and rec.pool is None
    await wait_for(lambda: len(f.pools["img-default"].ready) == 2, what="refill")
    with pytest.raises(Conflict):
        await f.take_from_pool("img-default", CloneSpec(instance_id="fast-1"))

    await f.configure_pool("img-default", "st", 0)
    assert await f.take_from_pool("img-default", CloneSpec(instance_id="fast-2")) is None
    assert [i.instance_id for i in await f.list_instances(include_pooled=True)] == [
        "fast-1",
        "gold",
    ]
    await f.drain_pools()
