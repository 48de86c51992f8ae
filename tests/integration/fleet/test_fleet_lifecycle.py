"""Lifecycle state machine on libvirt's test driver."""

from __future__ import annotations

import itertools

import pytest

from agentic_sandbox.fleet import (
    Conflict,
    InstanceSpec,
    InstanceState,
    InvalidRequest,
    NotFound,
    Resources,
)
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import wait_for


def spec(iid: str = "a1", **kw: object) -> InstanceSpec:
    return InstanceSpec(instance_id=iid, image="img", resources=Resources(memory_mib=256), **kw)  # type: ignore[arg-type]


async def test_full_lifecycle(env: Env) -> None:
    f = env.fleet
    inst = await f.create(spec(), start=False)
    assert inst.state is InstanceState.DEFINED
    assert inst.record.ssh_port is not None and inst.record.host == "h1"
    assert env.domains() == ["sbx-a1"]
    assert (await f.start("a1")).state is InstanceState.RUNNING
    assert (await f.start("a1")).state is InstanceState.RUNNING  # idempotent
    assert (await f.suspend("a1")).state is InstanceState.PAUSED
    assert (await f.suspend("a1")).state is InstanceState.PAUSED
    assert (await f.resume("a1")).state is InstanceState.RUNNING
    assert (await f.resume("a1")).state is InstanceState.RUNNING
    await f.reboot("a1", hard=True)
    assert (await f.shutdown("a1", grace_s=1)).state is InstanceState.SHUTOFF
    assert (await f.shutdown("a1")).state is InstanceState.SHUTOFF  # idempotent
    with pytest.raises(InvalidRequest):
        await f.suspend("a1")
    await f.start("a1")
    assert (await f.force_off("a1")).state is InstanceState.SHUTOFF
    assert (await f.force_off("a1")).state is InstanceState.SHUTOFF
    await f.delete("a1")
    await f.delete("a1")  # idempotent
    with pytest.raises(NotFound):
        await f.get("a1")
    assert env.domains() == [] and env.instance_files() == [] and env.volumes() == []
    assert f.hosts["h1"].ports.in_use() == set()
    await wait_for(lambda: "instance.deleted" in env.kinds("a1"))
    # every state change reported once, in order, never twice in a row
    states = env.states("a1")
    assert states[:3] == ["running", "paused", "running"]
    assert all(a != b for a, b in itertools.pairwise(states))
    assert env.kinds("a1").count("instance.created") == 1


async def test_create_is_idempotent_and_conflicts_on_different_request(env: Env) -> None:
    a = await env.fleet.create(spec())
    b = await env.fleet.create(spec())
    assert a.record.domain == b.record.domain and env.domains() == ["sbx-a1"]
    with pytest.raises(Conflict):
        await env.fleet.create(spec(owner="someone-else"))


async def test_events_follow_changes_made_outside_the_fleet(env: Env) -> None:
    await env.fleet.create(spec())
    conn = env.fleet.hosts["h1"].conn
    assert conn is not None
    conn.lookupByName("sbx-a1").suspend()
    await wait_for(lambda: env.fleet.index["a1"].state is InstanceState.PAUSED, what="paused")
    conn.lookupByName("sbx-a1").destroy()
    await wait_for(lambda: env.fleet.index["a1"].state is InstanceState.SHUTOFF, what="off")


async def test_list_and_filters(env: Env) -> None:
    await env.fleet.create(spec("a1", owner="alice"))
    await env.fleet.create(spec("a2", owner="bob"))
    assert [i.instance_id for i in await env.fleet.list_instances()] == ["a1", "a2"]
    assert [i.instance_id for i in await env.fleet.list_instances(owner="bob")] == ["a2"]


async def test_seed_is_copied_to_the_host(env: Env) -> None:
    # (swapping the seed of a running guest is a media change: shown in the real tier)
    seed = env.root / "seed.iso"
    seed.write_bytes(b"cidata-1")
    inst = await env.fleet.create(spec(seed=str(seed)))
    assert inst.record.seed == str(env.data / "instances" / "sbx-a1.seed.iso")
    assert (env.data / "instances" / "sbx-a1.seed.iso").read_bytes() == b"cidata-1"
    conn = env.fleet.hosts["h1"].conn
    assert conn is not None
    assert inst.record.seed in conn.lookupByName("sbx-a1").XMLDesc(0)
    await env.fleet.delete("a1")
    assert env.instance_files() == []


async def test_crash_restarts_then_crash_loop_stops(env: Env) -> None:
    import libvirt

    f = env.fleet
    await f.create(spec())
    h = f.hosts["h1"]
    assert h.conn is not None
    dom = h.conn.lookupByName("sbx-a1")
    for n in range(1, 4):
        dom.destroy()
        await wait_for(lambda: f.index["a1"].state is InstanceState.SHUTOFF)
        # what libvirt reports when QEMU dies under the guest (as the host's event callback
        # hands it on, on the loop thread)
        h._dispatch(
            "sbx-a1",
            dom.UUIDString(),
            libvirt.VIR_DOMAIN_EVENT_STOPPED,
            libvirt.VIR_DOMAIN_EVENT_STOPPED_FAILED,
        )
        assert f.index["a1"].state is InstanceState.CRASHED
        if n < 3:
            await wait_for(lambda: dom.isActive() == 1, what=f"restart after crash {n}")
            await wait_for(lambda: f.index["a1"].state is InstanceState.RUNNING)
    await wait_for(lambda: "instance.crash_loop" in env.kinds("a1"), what="crash loop")
    assert not dom.isActive()
    assert f.index["a1"].state is InstanceState.CRASHED
    assert env.kinds("a1").count("instance.crashed") == 3
    # the crash history is kept in the domain's metadata
    from agentic_sandbox.fleet.libvirt.domain_xml import parse_record

    rec = parse_record(dom.XMLDesc(0))
    assert rec is not None and len(rec.crashes) == 3


async def test_dry_run_preview_is_what_create_defines(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`preview_domain_xml` (provision-vm.sh --dry-run) shows the very definition create hands
    the host, for the same spec and the same host facts (domain type, SSH port, UUID); only the
    record's creation time differs, being another moment."""
    import xml.etree.ElementTree as ET

    from agentic_sandbox.fleet import (
        METADATA_NS,
        EgressPolicy,
        IoTune,
        KernelBoot,
        preview_domain_xml,
    )

    for name in ("kern", "initrd"):
        path = env.root / name
        path.write_bytes(b"\0" * 512)
        await env.fleet.import_image(name, str(path))
    seed = env.root / "seed.iso"
    seed.write_bytes(b"\0" * 2048)
    s = InstanceSpec(
        instance_id="p1",
        owner="o'<wn>",
        incarnation="3b1c2a5e-0000-4000-8000-000000000001",
        image="img",
        loadout="py",
        boot=KernelBoot(kernel="kern", initrd="initrd", cmdline="console=ttyS0 quiet"),
        resources=Resources(
            vcpus=2,
            memory_mib=384,
            cpu_shares=512,
            cpu_quota_pct=150,
            iotune=IoTune(total_iops_sec=300),
            tb_cache_mib=32,
        ),
        egress=EgressPolicy.NAT,
        agent_port=8124,
        seed=str(seed),
        host="h1",
        anti_affinity="web",
        restart_on_crash=False,
    )
    h = env.fleet.hosts["h1"]
    defined: list[str] = []
    define = h.define

    async def spy(definition: str):  # type: ignore[no-untyped-def]
        defined.append(definition)
        return await define(definition)

    monkeypatch.setattr(h, "define", spy)
    inst = await env.fleet.create(s, start=False)
    (created,) = defined
    preview = preview_domain_xml(
        s,
        env.fleet.config,
        domain_type=h.domain_type,
        ssh_port=inst.record.ssh_port or 0,
        uuid=env.fleet.index["p1"].uuid,
    )

    def canonical(xml: str) -> str:
        root = ET.fromstring(xml)
        at = root.find(f"metadata/{{{METADATA_NS}}}instance/created-at")
        assert at is not None
        at.text = "-"
        return ET.tostring(root, encoding="unicode")

    assert canonical(preview) == canonical(created)
