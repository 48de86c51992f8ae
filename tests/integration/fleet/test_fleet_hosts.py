"""Several hosts: placement spreads, labels steer, unreachable hosts are kept and retried."""

from __future__ import annotations

import pytest

from agentic_sandbox.fleet import (
    Conflict,
    HostSpec,
    InstanceSpec,
    InstanceState,
    NoCapacity,
    Resources,
)
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import node_uri


async def test_placement_spreads_and_follows_labels(env: Env) -> None:
    f = env.fleet
    await f.add_host(
        HostSpec(
            name="h2",
            uri=node_uri(env.root, "h2"),
            labels={"zone": "b"},
            data_dir=str(env.root / "h2"),
        )
    )
    img = env.root / "img.qcow2"
    await f.import_image("img", str(img), host="h2")
    for i in range(4):
        await f.create(
            InstanceSpec(instance_id=f"i{i}", image="img", resources=Resources(memory_mib=512))
        )
    hosts = sorted(i.host for i in await f.list_instances())
    assert hosts == ["h1", "h1", "h2", "h2"]
    z = await f.create(InstanceSpec(instance_id="zb", image="img", host_labels={"zone": "b"}))
    assert z.host == "h2"
    with pytest.raises(NoCapacity):
        await f.create(InstanceSpec(instance_id="zc", image="img", host_labels={"zone": "c"}))
    assert "zc" not in f.index
    info = {h.spec.name: h for h in await f.list_hosts()}
    assert info["h2"].instances == 3 and info["h2"].committed_memory_mib == 2 * 512 + 512
    with pytest.raises(Conflict):
        await f.remove_host("h2")


async def test_anti_affinity_spreads_a_group(env: Env) -> None:
    f = env.fleet
    await f.add_host(
        HostSpec(
            name="h2", uri=node_uri(env.root, "h2", memory_mib=4096), data_dir=str(env.root / "h2")
        )
    )
    await f.import_image("img", str(env.root / "img.qcow2"), host="h2")
    a = await f.create(InstanceSpec(instance_id="w1", image="img", anti_affinity="web"))
    b = await f.create(InstanceSpec(instance_id="w2", image="img", anti_affinity="web"))
    assert a.host != b.host


async def test_unreachable_host_is_kept_and_not_placed_on(env: Env) -> None:
    f = env.fleet
    info = await f.add_host(HostSpec(name="down", uri="qemu+unix:///system?socket=/nonexistent"))
    assert not info.reachable and info.reason
    assert "host.unreachable" in env.kinds()
    with pytest.raises(NoCapacity):
        await f.create(InstanceSpec(instance_id="x", image="img", host="down"))
    i = await f.create(InstanceSpec(instance_id="y", image="img"))
    assert i.host == "h1" and i.state is InstanceState.RUNNING
    await f.remove_host("down")
    assert [h.spec.name for h in await f.list_hosts()] == ["h1"]


async def test_add_host_is_idempotent(env: Env) -> None:
    spec = env.fleet.hosts["h1"].spec
    assert (await env.fleet.add_host(spec)).reachable
    with pytest.raises(Conflict):
        await env.fleet.add_host(spec.model_copy(update={"labels": {"x": "y"}}))
