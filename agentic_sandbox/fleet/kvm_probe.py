"""Does KVM really run guests here? Boot a kernel briefly under ``-accel kvm`` and watch.

A ``/dev/kvm`` node is not enough: on some machines it exists and opens but a guest kernel hangs.
The probe boots a Linux kernel with no root file system (``panic=-1``, ``-no-reboot``), which
prints its banner and panics within a second or two under KVM and then QEMU exits. Seeing the
kernel reach its panic (or any later marker) means KVM works; a timeout, an error or no output
means it does not, and the fleet uses TCG (domain type ``qemu``) instead, saying why.
"""

from __future__ import annotations

import glob
import os
import subprocess
import time
from dataclasses import dataclass

from .models import Accel

_MARKERS = ("Kernel panic", "VFS: Unable to mount root", "Run /init", "Freeing unused kernel")


@dataclass(frozen=True)
class AccelReport:
    accel: Accel
    reason: str
    seconds: float = 0.0


def find_probe_kernel() -> str | None:
    for pattern in ("/boot/vmlinuz-*", "/vmlinuz"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


def probe_kvm(
    kernel: str | None = None,
    *,
    timeout: float = 8.0,
    qemu: str = "qemu-system-x86_64",
    accel: str = "kvm",
) -> AccelReport:
    """Blocking: a few seconds at most. Runs QEMU directly (argv list, no shell).

    ``accel`` exists so tests can check the detection itself with ``tcg``."""
    if accel == "kvm" and not os.path.exists("/dev/kvm"):
        return AccelReport(Accel.TCG, "no /dev/kvm on this host")
    if accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelReport(Accel.TCG, "/dev/kvm is not accessible")
    kernel = kernel or find_probe_kernel()
    if kernel is None or not os.path.exists(kernel):
        return AccelReport(Accel.TCG, "no kernel to probe KVM with (install a linux-image)")
    argv = [
        qemu,
        "-accel",
        accel,
        "-machine",
        "pc",
        "-m",
        "128",
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-kernel",
        kernel,
        "-append",
        "console=ttyS0 panic=-1 loglevel=4",
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        if any(m in out for m in _MARKERS):
            return AccelReport(
                Accel(accel), f"kernel booted under {accel}", time.monotonic() - start
            )
        return AccelReport(
            Accel.TCG,
            f"a kernel under KVM did not boot within {timeout:.0f}s (hangs here)",
            time.monotonic() - start,
        )
    except OSError as e:
        return AccelReport(Accel.TCG, f"cannot run {qemu}: {e}")
    out = proc.stdout.decode(errors="replace")
    elapsed = time.monotonic() - start
    if any(m in out for m in _MARKERS):
        return AccelReport(Accel(accel), f"kernel booted under {accel} in {elapsed:.1f}s", elapsed)
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    why = err[-1] if err else f"QEMU exited {proc.returncode} without kernel output"
    return AccelReport(Accel.TCG, f"KVM unusable: {why}", elapsed)
