"""Fleet benchmark: each step through the fleet beside the same step with plain virsh/qemu-img.

Run: ``.venv/bin/python tests/bench/bench_fleet.py [--runs 5]`` (root, libvirtd running or
startable, ``linux-image-cloud-amd64`` + ``busybox-static`` installed). Prints a table and writes
``bench-results/fleet.json``. Guests are the tiny test guest under TCG; "marker" is the guest's
next serial-console line (boot marker for a cold boot, the next counter tick for a restore or a
resume; the guest ticks every 0.1 s, so marker times include up to 0.1 s of that wait; the
"(call)" row is the hand-off call alone).

Steps (p50 of N; overlay create: p50 of 5N after a warm-up, it is a millisecond step):
  overlay create        fleet create_overlay (libvirt volume API)  vs  qemu-img create -b
  cold boot to marker   fleet.create + start                       vs  virsh create (same XML)
  memory snapshot       fleet.create_snapshot                      vs  virsh snapshot-create-as
  revert                fleet.revert_snapshot                      vs  virsh snapshot-revert
  restore-clone→marker  fleet.clone_from_state (new name/UUID/disk) vs  qemu-img + virsh restore
                                                                       --xml (new disk only)
  warm-pool handoff     fleet.take_from_pool                        vs  virsh resume
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import libvirt  # noqa: E402

from agentic_sandbox.fleet import (  # noqa: E402
    CloneSpec,
    EgressPolicy,
    Fleet,
    FleetConfig,
    HostSpec,
    InstanceRecord,
    InstanceSpec,
    KernelBoot,
    Resources,
)
from agentic_sandbox.fleet.domain_config import DomainConfig, KernelPaths, NetConfig  # noqa: E402
from agentic_sandbox.fleet.libvirt.domain_xml import build_domain_xml  # noqa: E402
from tests.support import tiny_guest  # noqa: E402
from tests.support.libvirt_daemons import MAIN_URI, ensure_main_libvirtd  # noqa: E402

TICK = re.compile(rb"SBX-(TICK \d+|BOOT-MARKER)")
TARGETS = {
    "overlay create": 0.015,
    "restore-clone to marker": 1.5,
    "warm-pool handoff to marker": 0.3,
}


def virsh(*args: str) -> None:
    subprocess.run(["virsh", "-q", "-c", MAIN_URI, *args], check=True, stdout=subprocess.DEVNULL)


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


async def wait_file_marker(path: str, offset: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                if TICK.search(f.read()):
                    return
        except FileNotFoundError:
            pass
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no marker in {path}")


async def wait_fleet_marker(fleet: Fleet, iid: str, offset: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if TICK.search(await fleet.read_serial_log(iid, offset)):
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no marker for {iid}")


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


class Bench:
    def __init__(self, runs: int) -> None:
        self.runs = runs
        self.rows: dict[str, dict[str, list[float]]] = {}

    def add(self, step: str, kind: str, seconds: float) -> None:
        self.rows.setdefault(step, {"fleet": [], "plain": []})[kind].append(seconds)

    def report(self) -> dict[str, object]:
        out: dict[str, object] = {}
        print(f"\n{'step':30} {'fleet p50':>11} {'plain p50':>11} {'ratio':>7} {'target':>9}")
        for step, r in self.rows.items():
            f50 = statistics.median(r["fleet"])
            p50 = statistics.median(r["plain"]) if r["plain"] else None
            ratio = f50 / p50 if p50 else None
            target = TARGETS.get(step)
            print(
                f"{step:30} {f50 * 1000:9.1f}ms "
                f"{(p50 or 0) * 1000:9.1f}ms {ratio or 0:7.2f} "
                f"{'' if target is None else f'{target * 1000:.0f}ms':>9}"
            )
            out[step] = {
                "fleet_p50_s": f50,
                "plain_p50_s": p50,
                "ratio": ratio,
                "target_s": target,
                "fleet_runs_s": r["fleet"],
                "plain_runs_s": r["plain"],
            }
        return out


async def main(runs: int) -> None:
    load_start = os.getloadavg()
    ensure_main_libvirtd()
    guest = tiny_guest.build()
    root = Path(tempfile.mkdtemp(prefix="sbx-fleet-bench-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    plain = root / "plain"
    plain.mkdir()
    os.chmod(plain, 0o755)
    b = Bench(runs)
    fleet = Fleet(FleetConfig(data_dir=str(root / "fleet"), pool_memory_headroom_mib=256))
    plain_domains: list[str] = []
    try:
        await fleet.open([HostSpec(name="h1", uri=MAIN_URI, accel="tcg")])
        for name, path in (
            ("tiny-kernel", guest.kernel),
            ("tiny-initrd", guest.initrd),
            ("tiny-base", guest.base_disk),
        ):
            await fleet.import_image(name, str(path))
        h = fleet.hosts["h1"]
        _, storage = h.require()
        base = storage.path("bases", "tiny-base")
        kernel = storage.path("bases", "tiny-kernel")
        initrd = storage.path("bases", "tiny-initrd")

        def spec(iid: str) -> InstanceSpec:
            return InstanceSpec(
                instance_id=iid,
                image="tiny-base",
                egress=EgressPolicy.NAT,
                boot=KernelBoot(kernel="tiny-kernel", initrd="tiny-initrd", cmdline=guest.cmdline),
                resources=Resources(memory_mib=160, tb_cache_mib=32),
            )

        def plain_xml(name: str, overlay: str, log: str, port: int) -> str:
            rec = InstanceRecord(instance_id=name, domain=name, host="plain")
            return build_domain_xml(
                DomainConfig(
                    name=name,
                    uuid=str(uuidlib.uuid4()),
                    domain_type="qemu",
                    vcpus=1,
                    memory_mib=160,
                    overlay=overlay,
                    serial_log=log,
                    net=NetConfig(EgressPolicy.NAT, 8120, port),
                    record=rec,
                    boot=KernelPaths(kernel, initrd, guest.cmdline),
                    tb_cache_mib=32,
                )
            )

        # 1. overlay create (ms-scale: one warm-up each, then 5x the runs, interleaved) --
        async def fleet_overlay(i: int) -> None:
            await h.run(storage.create_overlay, "instances", f"sbx-bench-ov{i}.qcow2", base, None)

        async def plain_overlay(i: int) -> None:
            await asyncio.to_thread(
                subprocess.run,
                [
                    "qemu-img",
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-F",
                    "qcow2",
                    "-b",
                    base,
                    str(plain / f"ov{i}.qcow2"),
                ],
                check=True,
            )

        for i in range(-1, runs * 5):
            pair = [("fleet", fleet_overlay), ("plain", plain_overlay)]
            for kind, fn in pair if i % 2 == 0 else pair[::-1]:
                dt = await timed(lambda fn=fn, i=i: fn(i))
                if i >= 0:
                    b.add("overlay create", kind, dt)
            await h.run(storage.delete, storage.path("instances", f"sbx-bench-ov{i}.qcow2"))
            os.unlink(plain / f"ov{i}.qcow2")

        # 2. cold boot to marker -------------------------------------------------------
        async def cold_fleet(i: int) -> None:
            iid = f"bench-cold-{i}"

            async def fleet_boot() -> None:
                await fleet.create(spec(iid))
                await wait_fleet_marker(fleet, iid, 0)

            b.add("cold boot to marker", "fleet", await timed(fleet_boot))
            await fleet.delete(iid)

        async def cold_plain(i: int) -> None:
            name = f"plain-cold-{i}"
            ov, log = str(plain / f"{name}.qcow2"), str(plain / f"{name}.log")
            xml_path = plain / f"{name}.xml"
            xml_path.write_text(plain_xml(name, ov, log, 44100 + i))

            async def plain_boot() -> None:
                subprocess.run(
                    ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, ov],
                    check=True,
                )
                virsh("create", str(xml_path))
                await wait_file_marker(log, 0)

            plain_domains.append(name)
            b.add("cold boot to marker", "plain", await timed(plain_boot))
            virsh("destroy", name)

        for i in range(runs):  # ABBA: alternate which side boots first
            for one in (cold_fleet, cold_plain) if i % 2 == 0 else (cold_plain, cold_fleet):
                await one(i)

        # 3/4. snapshot + revert on one running guest each -----------------------------
        await fleet.create(spec("bench-snap"))
        await wait_fleet_marker(fleet, "bench-snap", 0)
        name = "plain-snap"
        ov, log = str(plain / f"{name}.qcow2"), str(plain / f"{name}.log")
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, ov], check=True
        )
        (plain / f"{name}.xml").write_text(plain_xml(name, ov, log, 44200))
        virsh("define", str(plain / f"{name}.xml"))
        plain_domains.append(name)
        virsh("start", name)
        await wait_file_marker(log, 0)

        async def plain_step(*args: str) -> None:
            await asyncio.to_thread(virsh, *args)

        for i in range(runs):  # alternate which goes first, and let each guest settle
            pair = [
                ("fleet", lambda i=i: fleet.create_snapshot("bench-snap", f"s{i}")),
                ("plain", lambda i=i: plain_step("snapshot-create-as", name, f"s{i}")),
            ]
            for kind, fn in pair if i % 2 == 0 else pair[::-1]:
                b.add("memory snapshot create", kind, await timed(fn))
                await asyncio.sleep(0.5)
        for i in range(runs):
            pair = [
                ("fleet", lambda i=i: fleet.revert_snapshot("bench-snap", f"s{i}")),
                ("plain", lambda i=i: plain_step("snapshot-revert", name, f"s{i}")),
            ]
            for kind, fn in pair if i % 2 == 0 else pair[::-1]:
                b.add("revert", kind, await timed(fn))
                await asyncio.sleep(1.0)
        await fleet.delete("bench-snap")
        virsh("destroy", name)
        virsh("undefine", name, "--snapshots-metadata")

        # 5. restore-clone to marker ---------------------------------------------------
        await fleet.create(spec("bench-gold"))
        await wait_fleet_marker(fleet, "bench-gold", 0)
        await asyncio.sleep(1)
        state = await fleet.capture_state("bench-gold", "bench-state")
        await fleet.delete("bench-gold")
        # plain baseline: a plain save of a plain domain, restored with --xml (new disk)
        name = "plain-gold"
        ov, log = str(plain / f"{name}.qcow2"), str(plain / f"{name}.log")
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, ov], check=True
        )
        (plain / f"{name}.xml").write_text(plain_xml(name, ov, log, 44300))
        virsh("create", str(plain / f"{name}.xml"))
        await wait_file_marker(log, 0)
        await asyncio.sleep(1)
        save = str(plain / "gold.save")
        virsh("save", name, save)
        frozen = ov
        save_xml = subprocess.run(
            ["virsh", "-c", MAIN_URI, "save-image-dumpxml", save],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

        async def clone_fleet(i: int) -> None:
            iid = f"bench-clone-{i}"

            async def fleet_clone() -> None:
                await fleet.clone_from_state(
                    state.state_id, CloneSpec(instance_id=iid, egress=EgressPolicy.NAT)
                )
                await wait_fleet_marker(fleet, iid, 0)

            b.add("restore-clone to marker", "fleet", await timed(fleet_clone))
            await fleet.delete(iid)

        async def clone_plain(i: int) -> None:
            cov = str(plain / f"clone{i}.qcow2")
            clog = str(plain / f"clone{i}.log")
            xml_i = save_xml.replace(ov, cov).replace(log, clog)
            (plain / f"clone{i}.xml").write_text(xml_i)

            async def plain_clone() -> None:
                subprocess.run(
                    ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", frozen, cov],
                    check=True,
                )
                virsh("restore", save, "--xml", str(plain / f"clone{i}.xml"))
                await wait_file_marker(clog, 0)

            b.add("restore-clone to marker", "plain", await timed(plain_clone))
            virsh("destroy", name)

        for i in range(runs):  # ABBA: alternate which side restores first
            for one in (clone_fleet, clone_plain) if i % 2 == 0 else (clone_plain, clone_fleet):
                await one(i)

        # 6. warm-pool handoff to marker ----------------------------------------------
        await fleet.configure_pool("bench", state.state_id, 1, egress=EgressPolicy.NAT, wait=True)
        for i in range(runs):
            slot = fleet.pools.slots["bench"]
            while not slot.ready:
                await asyncio.sleep(0.05)
            member = slot.ready[0]
            offset = len(await fleet.read_serial_log(member))
            iid = f"bench-warm-{i}"

            call: list[float] = []

            async def take(iid: str = iid, offset: int = offset, call: list[float] = call) -> None:
                t = time.perf_counter()
                got = await fleet.take_from_pool(
                    "bench", CloneSpec(instance_id=iid, egress=EgressPolicy.NAT)
                )
                call.append(time.perf_counter() - t)
                assert got is not None
                await wait_fleet_marker(fleet, iid, offset)

            b.add("warm-pool handoff to marker", "fleet", await timed(take))
            b.add("warm-pool handoff (call)", "fleet", call[0])
            await fleet.delete(iid)
            # plain: resume a paused restored domain
            cov = str(plain / f"clone{i}.qcow2")
            clog = str(plain / f"clone{i}.log")
            subprocess.run(
                ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", frozen, cov],
                check=True,
            )
            # same as a pool member: restored, run briefly (warm TCG cache), paused
            virsh("restore", save, "--xml", str(plain / f"clone{i}.xml"))
            await asyncio.sleep(fleet.config.pool_warmup_s)
            virsh("suspend", name)
            poff = file_size(clog)

            pcall: list[float] = []

            async def resume(
                clog: str = clog, poff: int = poff, pcall: list[float] = pcall
            ) -> None:
                t = time.perf_counter()
                virsh("resume", name)
                pcall.append(time.perf_counter() - t)
                await wait_file_marker(clog, poff)

            b.add("warm-pool handoff to marker", "plain", await timed(resume))
            b.add("warm-pool handoff (call)", "plain", pcall[0])
            virsh("destroy", name)
        await fleet.drain_pools()
        await fleet.delete_state(state.state_id)
    finally:
        for iid in list(fleet.index):
            with contextlib.suppress(Exception):
                await fleet.delete(iid)
        for st in list(fleet.states.saved):
            with contextlib.suppress(Exception):
                await fleet.delete_state(st)
        with contextlib.suppress(Exception):
            await fleet.remove_host("h1", force=True, forget_storage=True)
        await fleet.close()
        conn = libvirt.open(MAIN_URI)
        for dname in plain_domains:
            with contextlib.suppress(libvirt.libvirtError):
                d = conn.lookupByName(dname)
                if d.isActive():
                    d.destroy()
                d.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)
        conn.close()
        shutil.rmtree(root, ignore_errors=True)

    results = b.report()
    load_end = os.getloadavg()
    loads = " -> ".join(" ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end))
    print(f"load average start -> end: {loads}")
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    payload = {
        "runs": runs,
        "uri": MAIN_URI,
        "accel": "tcg",
        "guest": "tiny (cloud kernel + busybox initramfs, 160 MiB, tb-cache 32 MiB)",
        "steps": results,
        "loadavg_at_start": [round(x, 2) for x in load_start],
        "loadavg_at_end": [round(x, 2) for x in load_end],
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / "fleet.json").write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out / 'fleet.json'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    asyncio.run(main(ap.parse_args().runs))
