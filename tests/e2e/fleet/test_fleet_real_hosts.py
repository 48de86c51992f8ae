"""Two hosts (a second private libvirtd), host loss and return, main libvirtd restart."""

from __future__ import annotations

import asyncio
import time

import libvirt
import pytest

from agentic_sandbox.fleet import HostSpec, InstanceState
from tests.support.fleet_real_env import RealEnv, domains_under, wait_log
from tests.support.libvirt_daemons import MAIN_URI, PrivateLibvirtd, restart_main_libvirtd

pytestmark = pytest.mark.libvirt_real


async def until(pred, timeout: float = 30.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        await asyncio.sleep(0.05)


async def test_second_host_placement_loss_and_return(real: RealEnv) -> None:
    f = real.fleet
    h2 = PrivateLibvirtd(real.root / "h2-daemon")
    real.extra_cleanup.append(h2.destroy_everything)
    await asyncio.to_thread(h2.start)
    conn2 = libvirt.open(h2.uri)
    assert conn2.listAllNetworks(0) == []  # its own daemon: no networks, no bridges
    conn2.close()
    # files="remote": base images, serial logs and save headers go through libvirt streams.
    # (Both "hosts" share this machine's loopback, so give them distinct forward ports.)
    info = await f.add_host(
        HostSpec(
            name="h2",
            uri=h2.uri,
            accel="tcg",
            files="remote",
            data_dir=str(real.root / "h2"),
            ssh_port_range=(43200, 43299),
        )
    )
    assert info.reachable, info
    for name, path in (
        ("tiny-kernel", real.guest.kernel),
        ("tiny-initrd", real.guest.initrd),
        ("tiny-base", real.guest.base_disk),
    ):
        await f.import_image(name, str(path), host="h2")

    a, b = await asyncio.gather(f.create(real.spec("spread-a")), f.create(real.spec("spread-b")))
    assert {a.host, b.host} == {"h1", "h2"}
    on_h2 = a if a.host == "h2" else b
    on_h1 = b if on_h2 is a else a
    await wait_log(f, on_h2.instance_id, rb"SBX-TICK 1\b")  # read over a storage stream
    await wait_log(f, on_h1.instance_id, rb"SBX-TICK 1\b")

    # host 2 goes away: its instance is unknown, not deleted; host 1 is untouched
    await asyncio.to_thread(h2.stop)
    await until(lambda: f.index[on_h2.instance_id].state is InstanceState.UNKNOWN, what="unknown")
    assert "host.unreachable" in real.kinds()
    assert f.index[on_h1.instance_id].state is InstanceState.RUNNING
    assert not (await f.host_info("h2")).reachable

    # it comes back: reconnect + reconcile, the guest kept running the whole time
    await asyncio.to_thread(h2.start)
    await until(
        lambda: f.index[on_h2.instance_id].state is InstanceState.RUNNING, what="reconciled"
    )
    assert "host.reconnected" in real.kinds()
    assert real.kinds(on_h2.instance_id).count("instance.lost") == 0
    assert len(await f.list_instances()) == 2
    offset = len(await f.read_serial_log(on_h2.instance_id))
    await wait_log(f, on_h2.instance_id, rb"SBX-TICK \d+", offset=offset)

    await f.delete(on_h2.instance_id)
    await f.delete(on_h1.instance_id)
    conn2 = libvirt.open(h2.uri)
    assert conn2.listAllDomains(0) == []
    conn2.close()
    assert await f.reconcile("h2")


async def test_main_libvirtd_restart_keeps_everything(real: RealEnv) -> None:
    f = real.fleet
    await f.create(real.spec("survivor"))
    await wait_log(f, "survivor", rb"SBX-TICK 1\b")
    before = [(i.instance_id, i.record.domain) for i in await f.list_instances()]
    connects = f.hosts["h1"].connect_count

    await asyncio.to_thread(restart_main_libvirtd)
    await until(lambda: f.hosts["h1"].connect_count > connects, what="reconnect")
    await until(lambda: f.index["survivor"].state is InstanceState.RUNNING, what="running")
    after = [(i.instance_id, i.record.domain) for i in await f.list_instances()]
    assert before == after  # nothing lost, nothing duplicated
    assert "instance.lost" not in real.kinds("survivor")
    assert real.kinds().count("host.reconnected") == 1

    # events flow again: a change made outside the fleet reaches it at once
    conn = libvirt.open(MAIN_URI)
    try:
        conn.lookupByName("sbx-survivor").suspend()
        await until(lambda: f.index["survivor"].state is InstanceState.PAUSED, 10, "paused")
        conn.lookupByName("sbx-survivor").resume()
        await until(lambda: f.index["survivor"].state is InstanceState.RUNNING, 10, "resumed")
    finally:
        conn.close()
    await f.delete("survivor")
    assert domains_under(MAIN_URI, real.root) == []
