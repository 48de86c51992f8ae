"""Reconciliation with libvirt: vanished domains, unknown domains, orphans, host loss."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from agentic_sandbox.fleet import (
    Fleet,
    FleetConfig,
    FleetEvent,
    HostSpec,
    HostUnavailable,
    InstanceRecord,
    InstanceSpec,
    InstanceState,
)
from agentic_sandbox.fleet.domain_config import DomainConfig, NetConfig
from agentic_sandbox.fleet.libvirt.domain_xml import build_domain_xml
from agentic_sandbox.fleet.models import EgressPolicy
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import node_uri, wait_for


async def test_domain_removed_behind_the_fleets_back_is_lost(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="a1", image="img"))
    conn = f.hosts["h1"].conn
    assert conn is not None
    dom = conn.lookupByName("sbx-a1")
    dom.destroy()
    dom.undefine()
    await wait_for(lambda: f.index["a1"].state is InstanceState.LOST, what="lost")
    assert "instance.lost" in env.kinds("a1")
    # an explicit reconcile agrees and does not report it twice
    (report,) = await f.reconcile("h1")
    assert report.lost == [] and env.kinds("a1").count("instance.lost") == 1
    # delete cleans what is left of it
    await f.delete("a1")
    assert env.instance_files() == [] and env.volumes() == []


def ghost_xml(env: Env, iid: str, name: str | None = None, data_dir: Path | None = None) -> str:
    name = name or f"sbx-{iid}"
    instances = (data_dir or env.data) / "instances"
    rec = InstanceRecord(
        instance_id=iid,
        domain=name,
        host="h1",
        image="img",
        overlay=str(instances / f"{name}.qcow2"),
        serial_log=str(instances / f"{name}.serial.log"),
        ssh_port=42999,
        memory_mib=128,
    )
    return build_domain_xml(
        DomainConfig(
            name=name,
            uuid=str(uuid.uuid4()),
            domain_type="test",
            vcpus=1,
            memory_mib=128,
            overlay=rec.overlay,
            serial_log=rec.serial_log,
            net=NetConfig(EgressPolicy.NAT, 8120, 42999),
            record=rec,
        )
    )


async def test_unknown_fleet_domain_is_adopted_foreign_ones_ignored(env: Env) -> None:
    f = env.fleet
    conn = f.hosts["h1"].conn
    assert conn is not None
    conn.defineXML(ghost_xml(env, "ghost"))
    await wait_for(lambda: "ghost" in f.index, what="adoption from the define event")
    assert f.index["ghost"].state is InstanceState.SHUTOFF
    assert "instance.adopted" in env.kinds("ghost")
    assert 42999 in f.hosts["h1"].ports.in_use()
    conn.defineXML(
        "<domain type='test'><name>someone-else</name><memory>65536</memory>"
        "<os><type>hvm</type></os></domain>"
    )
    conn.defineXML(
        "<domain type='test'><name>sbx-no-metadata</name><memory>65536</memory>"
        "<os><type>hvm</type></os></domain>"
    )
    (report,) = await f.reconcile("h1")
    assert {"someone-else", "sbx-no-metadata"} <= set(report.foreign)
    assert "someone-else" not in f.index and "no-metadata" not in f.index
    await f.start("ghost")
    assert (await f.get("ghost")).state is InstanceState.RUNNING
    await f.delete("ghost")
    assert "someone-else" in env.domains()  # never touched


async def test_another_data_directorys_domains_are_never_adopted(env: Env) -> None:
    """Two fleets (a server and a test run, say) share one libvirtd: each adopts only the
    domains whose disks are in its own data directory, so neither deletes the other's VMs."""
    f = env.fleet
    conn = f.hosts["h1"].conn
    assert conn is not None
    conn.defineXML(ghost_xml(env, "theirs", data_dir=env.root / "another-server"))
    conn.defineXML(ghost_xml(env, "ours"))
    await wait_for(lambda: "ours" in f.index, what="adoption of our own domain")
    (report,) = await f.reconcile("h1")
    assert "sbx-theirs" in report.foreign and "theirs" not in f.index
    assert 42999 in f.hosts["h1"].ports.in_use()  # claimed by ours only
    await f.delete("ours")
    assert "sbx-theirs" in env.domains()


async def test_orphan_files_are_removed_others_kept(env: Env) -> None:
    inst = env.data / "instances"
    (inst / "sbx-gone.qcow2").write_bytes(b"x")
    (inst / "sbx-gone.serial.log").write_bytes(b"x")
    (inst / "operator-notes.txt").write_bytes(b"keep me")
    await env.fleet.create(InstanceSpec(instance_id="live", image="img"))
    (inst / "sbx-live.serial.log").write_bytes(b"console")
    (report,) = await env.fleet.reconcile("h1")
    assert sorted(report.orphans_removed) == ["sbx-gone.qcow2", "sbx-gone.serial.log"]
    assert sorted(env.instance_files()) == ["operator-notes.txt", "sbx-live.serial.log"]
    assert "fleet.orphan_removed" in env.kinds()


async def test_known_records_without_domains_are_lost_on_open(env: Env) -> None:
    rec = InstanceRecord(instance_id="was-here", domain="sbx-was-here", host="h2")
    events: list[FleetEvent] = []
    f2 = Fleet(FleetConfig(data_dir=str(env.root / "f2")), on_event=events.append)
    try:
        await f2.open([HostSpec(name="h2", uri=node_uri(env.root, "h2"))], known=[rec])
        assert (await f2.get("was-here")).state is InstanceState.LOST
        assert [e.kind.value for e in events if e.instance_id == "was-here"] == ["instance.lost"]
    finally:
        await f2.close()


async def test_host_loss_marks_unknown_then_reconnect_reconciles(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="a1", image="img"))
    h = f.hosts["h1"]
    h.mark_unreachable("simulated link loss")
    assert f.index["a1"].state is InstanceState.UNKNOWN
    assert "host.unreachable" in env.kinds()
    # the test driver comes back empty: the instance's domain is gone, so it is lost
    await wait_for(lambda: h.conn is not None, what="reconnect")
    await wait_for(lambda: f.index["a1"].state is InstanceState.LOST, what="reconciled")
    assert "host.reconnected" in env.kinds()
    lost = [e for e in env.events if e.instance_id == "a1" and e.kind.value == "instance.lost"]
    assert len(lost) == 1


async def test_a_delete_refused_while_the_host_is_away_leaves_the_instance_as_it_was(
    env: Env,
) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="a1", image="img"))
    h = f.hosts["h1"]
    h.mark_unreachable("simulated link loss")
    with pytest.raises(HostUnavailable):
        await f.delete("a1")
    assert not f.index["a1"].deleting
    # when the host answers again the instance is reconciled like any other (here: lost, the
    # test driver comes back empty), and a delete then goes through
    await wait_for(lambda: h.conn is not None, what="reconnect")
    await wait_for(lambda: f.index["a1"].state is InstanceState.LOST, what="reconciled")
    await f.delete("a1")
    assert "a1" not in f.index
