"""Real QEMU (TCG): boot, memory snapshot + revert, saved-state clone, warm pool, delete."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import libvirt
import pytest

from agentic_sandbox.fleet import CloneSpec, InstanceState, probe_kvm
from tests.support.fleet_real_env import RealEnv, domains_under, port_listening, ticks, wait_log
from tests.support.libvirt_daemons import MAIN_URI

pytestmark = pytest.mark.libvirt_real


async def test_boot_snapshot_revert_clone_pool_delete(real: RealEnv) -> None:
    f = real.fleet
    a = await f.create(real.spec("real-a"))
    assert a.state is InstanceState.RUNNING
    await wait_log(f, "real-a", rb"SBX-BOOT-MARKER")
    _, data = await wait_log(f, "real-a", rb"SBX-TICK 5\b")
    assert a.record.ssh_port is not None and port_listening(a.record.ssh_port)

    # memory snapshot, then let the counter run on, then revert: the counter goes back
    snap = await f.create_snapshot("real-a", "s1")
    assert snap.with_memory
    at_snapshot = max(ticks(await f.read_serial_log("real-a")))
    _, data = await wait_log(f, "real-a", rf"SBX-TICK {at_snapshot + 15}\b".encode())
    before_revert = max(ticks(data))
    offset = len(await f.read_serial_log("real-a"))
    reverted = await f.revert_snapshot("real-a", "s1")
    assert reverted.state is InstanceState.RUNNING
    _, after = await wait_log(f, "real-a", rb"SBX-TICK \d+", offset=offset)
    first_after = ticks(after)[0]
    assert at_snapshot <= first_after <= at_snapshot + 5 < before_revert, (
        at_snapshot,
        first_after,
        before_revert,
    )
    assert [s.name for s in await f.list_snapshots("real-a")] == ["s1"]

    # hand the running guest a new seed (a media change on its seed drive)
    seed = real.root / "seed.iso"
    seed.write_bytes(b"\0" * 2048 * 4)
    swapped = await f.set_seed("real-a", str(seed))
    assert swapped.record.seed and os.path.exists(swapped.record.seed)

    # capture its memory as a saved state, then restore it as a new instance
    captured_at = ticks(await f.read_serial_log("real-a"))[-1]
    state = await f.capture_state("real-a", "tiny-golden")
    assert (await f.get("real-a")).state is InstanceState.SHUTOFF
    clone = await f.clone_from_state("tiny-golden", CloneSpec(instance_id="real-clone"))
    assert clone.state is InstanceState.RUNNING and clone.record.domain == "sbx-real-clone"
    _, cdata = await wait_log(f, "real-clone", rb"SBX-TICK \d+")
    assert ticks(cdata)[0] >= captured_at - 1  # the guest went on where it was saved
    assert b"SBX-BOOT-MARKER" not in cdata  # restored, not booted
    conn = libvirt.open(MAIN_URI)
    try:
        src_uuid = conn.lookupByName("sbx-real-a").UUIDString()
        assert conn.lookupByName("sbx-real-clone").UUIDString() != src_uuid
    finally:
        conn.close()
    assert clone.record.ssh_port != a.record.ssh_port and port_listening(clone.record.ssh_port)

    # warm pool from the same state: the hand-off is a metadata rewrite + resume
    status = await f.configure_pool("tiny", state.state_id, 1, wait=True)
    assert status.ready == 1, status
    fast = await f.take_from_pool("tiny", CloneSpec(instance_id="real-fast"))
    assert fast is not None and fast.state is InstanceState.RUNNING
    await wait_log(f, "real-fast", rb"SBX-TICK \d+")
    await f.drain_pools()

    # delete everything: no domain, file or port is left
    ports = [i.record.ssh_port for i in await f.list_instances()]
    for iid in ("real-a", "real-clone", "real-fast"):
        await f.delete(iid)
    await f.delete_state("tiny-golden")
    assert domains_under(MAIN_URI, real.root) == []
    assert sorted(os.listdir(real.root / "h1" / "instances")) == []
    assert sorted(os.listdir(real.root / "h1" / "states")) == []
    for p in ports:
        assert p is not None and not port_listening(p)
    assert f.hosts["h1"].ports.in_use() == set()


async def test_shutdown_times_out_then_forces_and_crash_restarts(real: RealEnv) -> None:
    f = real.fleet
    await f.create(real.spec("real-crash"))
    await wait_log(f, "real-crash", rb"SBX-TICK 1\b")
    # the tiny guest ignores ACPI power button: graceful shutdown times out, then forced
    t0 = time.monotonic()
    off = await f.shutdown("real-crash", grace_s=1.5)
    assert off.state is InstanceState.SHUTOFF and "forced" in off.state_reason
    assert time.monotonic() - t0 >= 1.5
    await f.start("real-crash")
    await wait_log(f, "real-crash", rb"SBX-TICK 1\b")
    # kill QEMU under the guest: libvirt reports a failure, the fleet restarts it
    conn = libvirt.open(MAIN_URI)
    try:
        dom = conn.lookupByName("sbx-real-crash")
        pid = int(Path(f"/run/libvirt/qemu/{dom.name()}.pid").read_text())
    finally:
        conn.close()
    offset = len(await f.read_serial_log("real-crash"))
    os.kill(pid, 9)
    await wait_log(f, "real-crash", rb"SBX-BOOT-MARKER", offset=offset)
    assert "instance.crashed" in real.kinds("real-crash")
    for _ in range(100):
        if f.index["real-crash"].state is InstanceState.RUNNING:
            break
        await asyncio.sleep(0.05)
    assert f.index["real-crash"].state is InstanceState.RUNNING


def test_kvm_probe_really_boots_and_reports_why() -> None:
    # TCG always works: the probe's own detection sees the kernel boot
    tcg = probe_kvm(accel="tcg", timeout=30)
    assert tcg.accel.value == "tcg" and "booted" in tcg.reason, tcg
    report = probe_kvm(timeout=6)
    assert report.reason
    if report.accel.value == "kvm":
        assert "booted" in report.reason
    else:  # on these machines /dev/kvm exists but a kernel hangs under it
        assert any(
            w in report.reason
            for w in ("did not boot", "no /dev/kvm", "unusable", "not accessible", "no kernel")
        ), report
