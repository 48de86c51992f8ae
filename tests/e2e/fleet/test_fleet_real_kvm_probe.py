"""The KVM probe on this machine, remembered across starts (real QEMU, real /dev/kvm).

A fleet that opens a host with `accel="auto"` and no memory probes (a kernel boot of up to the
probe's timeout: 8 s here, where KVM hangs) and remembers the answer in the host's data
directory. The next start (a new process: the in-process memo is cleared) takes the remembered
answer at once and probes again in the background; when the fresh answer differs from the
remembered one (planted here: the opposite of the truth), the host's accelerator and domain
type follow the fresh one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from agentic_sandbox.fleet import Fleet, FleetConfig, HostSpec
from agentic_sandbox.fleet.libvirt import host as fleet_connection
from agentic_sandbox.fleet.models import Accel
from tests.support.fleet_real_env import purge_domains
from tests.support.libvirt_daemons import MAIN_URI, ensure_main_libvirtd


def probe_qemus() -> list[int]:
    """This process's children that are the KVM probe's QEMU."""
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat[1] == me and stat[0] != "Z" and b"panic=-1 loglevel=4" in cmdline:
            found.append(int(pid))
    return found


async def open_host(data: Path) -> Fleet:
    fleet_connection._probe_cache.clear()  # a restart: this process has probed nothing
    fleet = Fleet(FleetConfig(data_dir=str(data)))
    await fleet.open([HostSpec(name="h1", uri=MAIN_URI, accel="auto")])
    return fleet


async def test_the_probe_is_remembered_reused_at_start_and_redone_in_the_background() -> None:
    ensure_main_libvirtd()
    root = Path(tempfile.mkdtemp(prefix="sbx-kvm-probe-", dir="/var/tmp"))
    memory = root / "fleet" / "kvm-probe.json"
    try:
        fleet = await open_host(root / "fleet")
        first = fleet.accel("h1")
        assert first is not None and not first.remembered and first.probed_at > 0
        truth = first.accel
        assert json.loads(memory.read_text())["report"]["accel"] == truth.value
        await fleet.close()

        # plant the opposite answer under the same key: the next start must believe it at
        # first (no probe on the start's path) and correct it from a fresh probe
        doc = json.loads(memory.read_text())
        lie = Accel.TCG if truth is Accel.KVM else Accel.KVM
        doc["report"]["accel"] = lie.value
        memory.write_text(json.dumps(doc))
        fleet = await open_host(root / "fleet")
        try:
            h = fleet.hosts["h1"]
            at_start = fleet.accel("h1")
            assert at_start is not None and at_start.remembered and at_start.accel is lie
            assert "remembered" in (await fleet.host_info("h1")).accel_reason
            assert h.domain_type == ("kvm" if lie is Accel.KVM else "qemu")
            deadline = time.monotonic() + 120
            while (now := fleet.accel("h1")) is not None and now.remembered:
                assert time.monotonic() < deadline, "no re-probe in the background"
                await asyncio.sleep(0.2)
            assert now is not None and now.accel is truth
            assert h.domain_type == ("kvm" if truth is Accel.KVM else "qemu")
            assert json.loads(memory.read_text())["report"]["accel"] == truth.value
        finally:
            await fleet.remove_host("h1", force=True, forget_storage=True)
            await fleet.close()

        # a fleet closed while it probes again in the background (a server stopping soon
        # after its start) ends the probe's QEMU with it: nothing is left to wait out the
        # probe's window before the process may exit
        fleet = await open_host(root / "fleet")
        async with asyncio.timeout(10):
            while not probe_qemus():
                await asyncio.sleep(0.05)
        await fleet.close()
        assert probe_qemus() == []
    finally:
        purge_domains(MAIN_URI, root)
        shutil.rmtree(root, ignore_errors=True)
