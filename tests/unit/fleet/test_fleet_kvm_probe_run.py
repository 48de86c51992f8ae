"""Running the KVM probe: what its QEMU prints decides the answer, a QEMU that hangs past the
boot window is killed, and a cancelled background probe (a server stopping) kills its QEMU at
once instead of leaving the process to wait out the window (a stop once took 8.5 s so)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agentic_sandbox.fleet.kvm_probe import probe_kvm, probe_kvm_async
from agentic_sandbox.fleet.models import Accel


def fake_qemu(tmp_path: Path, body: str) -> tuple[str, Path]:
    """A stand-in for qemu-system-x86_64 that records its pid, then runs `body`."""
    pidfile = tmp_path / "qemu.pid"
    script = tmp_path / "qemu"
    script.write_text(f"#!/bin/sh\necho $$ > {pidfile}\n{body}\n")
    script.chmod(0o755)
    return str(script), pidfile


def alive(pidfile: Path) -> bool:
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone as far as the probe goes
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_kernel_that_reaches_its_panic_means_the_accelerator_works(tmp_path: Path) -> None:
    qemu, _ = fake_qemu(tmp_path, "echo 'Linux version 6.1'; echo 'Kernel panic - not syncing'")
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"")
    for report in (
        probe_kvm(str(kernel), qemu=qemu, accel="tcg", timeout=10),
        await probe_kvm_async(str(kernel), qemu=qemu, accel="tcg", boot_window=10),
    ):
        assert report.accel is Accel.TCG and "kernel booted under tcg" in report.reason
        assert report.probed_at > 0


async def test_a_qemu_that_fails_is_named_and_one_that_hangs_is_killed(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"")
    qemu, _ = fake_qemu(tmp_path, "echo 'could not access KVM kernel module' >&2; exit 1")
    report = await probe_kvm_async(str(kernel), qemu=qemu, accel="tcg", boot_window=10)
    assert report.reason == "KVM unusable: could not access KVM kernel module"

    qemu, pidfile = fake_qemu(tmp_path, "exec sleep 60")
    report = await probe_kvm_async(str(kernel), qemu=qemu, accel="tcg", boot_window=0.5)
    assert report.accel is Accel.TCG and "did not boot within" in report.reason
    assert not alive(pidfile)


async def test_a_cancelled_probe_kills_its_qemu_at_once(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"")
    qemu, pidfile = fake_qemu(tmp_path, "exec sleep 60")
    probe = asyncio.create_task(
        probe_kvm_async(str(kernel), qemu=qemu, boot_window=60, accel="tcg")
    )
    async with asyncio.timeout(10):
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.02)
    assert alive(pidfile)
    probe.cancel()
    async with asyncio.timeout(5):  # not the 60 s window
        await asyncio.gather(probe, return_exceptions=True)
    assert probe.cancelled()
    assert not alive(pidfile)
