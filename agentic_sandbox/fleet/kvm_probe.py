"""Does KVM really run guests here? Boot a kernel briefly under ``-accel kvm`` and watch.

A ``/dev/kvm`` node is not enough: on some machines it exists and opens but a guest kernel hangs.
The probe boots a Linux kernel with no root file system (``panic=-1``, ``-no-reboot``), which
prints its banner and panics within a second or two under KVM and then QEMU exits. Seeing the
kernel reach its panic (or any later marker) means KVM works; a timeout, an error or no output
means it does not, and the fleet uses TCG (domain type ``qemu``) instead, saying why.

Booting that kernel takes up to the probe's timeout (8 s where KVM hangs), so the answer is
remembered per host (`ProbeMemory`, a JSON file in the host's data directory) under what it
depends on (`probe_key`): the running kernel, the QEMU binary's version, the probe kernel, and
``/dev/kvm``'s identity (device numbers, inode, mode, owner, times — a reboot, a module reload
or a permission change makes a new one). A start whose key matches uses the remembered answer
at once and probes again in the background; see ``libvirt.host.LibvirtHost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from .models import Accel

_MARKERS = ("Kernel panic", "VFS: Unable to mount root", "Run /init", "Freeing unused kernel")


@dataclass(frozen=True)
class AccelReport:
    accel: Accel
    reason: str
    seconds: float = 0.0
    probed_at: float = 0.0  # time.time() of the probe (0: not probed)
    remembered: bool = False  # taken from the host's probe memory, not probed by this process


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
    argv = _probe_argv(kernel, qemu, accel)
    if isinstance(argv, AccelReport):
        return argv
    start = time.monotonic()
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        report = _timed_out(e.stdout or b"", accel, timeout, start)
    except OSError as e:
        return AccelReport(Accel.TCG, f"cannot run {qemu}: {e}")
    else:
        report = _exited(proc.stdout, proc.stderr, proc.returncode, accel, start)
    return replace(report, probed_at=time.time())


async def probe_kvm_async(
    kernel: str | None = None,
    *,
    boot_window: float = 8.0,
    qemu: str = "qemu-system-x86_64",
    accel: str = "kvm",
) -> AccelReport:
    """`probe_kvm` on the event loop (`boot_window`: its `timeout`, whose end is an answer,
    not an error); cancelling it kills the probe's QEMU at once (a server that stops during
    a background re-probe must not wait out the window)."""
    argv = _probe_argv(kernel, qemu, accel)
    if isinstance(argv, AccelReport):
        return argv
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        return AccelReport(Accel.TCG, f"cannot run {qemu}: {e}")
    out = bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    errs = asyncio.ensure_future(proc.stderr.read())
    try:
        async with asyncio.timeout(boot_window):
            while chunk := await proc.stdout.read(65536):
                out += chunk
            await proc.wait()
    except TimeoutError:
        report = _timed_out(bytes(out), accel, boot_window, start)
    else:
        report = _exited(bytes(out), await errs, proc.returncode or 0, accel, start)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
        errs.cancel()
    return replace(report, probed_at=time.time())


def _probe_argv(kernel: str | None, qemu: str, accel: str) -> list[str] | AccelReport:
    """The probe's QEMU command line, or the answer when there is nothing to probe with."""
    if accel == "kvm" and not os.path.exists("/dev/kvm"):
        return AccelReport(Accel.TCG, "no /dev/kvm on this host")
    if accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelReport(Accel.TCG, "/dev/kvm is not accessible")
    kernel = kernel or find_probe_kernel()
    if kernel is None or not os.path.exists(kernel):
        return AccelReport(Accel.TCG, "no kernel to probe KVM with (install a linux-image)")
    return [
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


def _timed_out(stdout: bytes, accel: str, timeout: float, start: float) -> AccelReport:
    out = stdout.decode(errors="replace")
    if any(m in out for m in _MARKERS):
        return AccelReport(Accel(accel), f"kernel booted under {accel}", time.monotonic() - start)
    return AccelReport(
        Accel.TCG,
        f"a kernel under KVM did not boot within {timeout:.0f}s (hangs here)",
        time.monotonic() - start,
    )


def _exited(stdout: bytes, stderr: bytes, returncode: int, accel: str, start: float) -> AccelReport:
    out = stdout.decode(errors="replace")
    elapsed = time.monotonic() - start
    if any(m in out for m in _MARKERS):
        return AccelReport(Accel(accel), f"kernel booted under {accel} in {elapsed:.1f}s", elapsed)
    err = stderr.decode(errors="replace").strip().splitlines()
    why = err[-1] if err else f"QEMU exited {returncode} without kernel output"
    return AccelReport(Accel.TCG, f"KVM unusable: {why}", elapsed)


def _dev_kvm() -> dict[str, Any] | None:
    try:
        st = os.stat("/dev/kvm")
    except OSError:
        return None
    return {
        "rdev": [os.major(st.st_rdev), os.minor(st.st_rdev)],
        "ino": st.st_ino,
        "mode": st.st_mode,
        "uid": st.st_uid,
        "gid": st.st_gid,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "rw": os.access("/dev/kvm", os.R_OK | os.W_OK),
    }


def _qemu_version(qemu: str) -> str:
    try:
        out = subprocess.run(
            [qemu, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def probe_key(kernel: str | None = None, qemu: str = "qemu-system-x86_64") -> dict[str, Any]:
    """What the probe's answer depends on (blocking: runs ``qemu --version``)."""
    probe_kernel = kernel or find_probe_kernel()
    kernel_stat = None
    if probe_kernel is not None:
        with contextlib.suppress(OSError):
            st = os.stat(probe_kernel)
            kernel_stat = [st.st_size, st.st_mtime_ns]
    u = os.uname()
    return {
        "host_kernel": f"{u.release} {u.version}",
        "qemu": _qemu_version(qemu),
        "probe_kernel": [probe_kernel, kernel_stat],
        "dev_kvm": _dev_kvm(),
    }


class ProbeMemory:
    """The last probe's answer for one host, kept in a JSON file with the key it was made
    under; recalled only for the same key."""

    def __init__(self, path: str) -> None:
        self.path = path

    def recall(self, key: dict[str, Any]) -> AccelReport | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
            if doc.get("key") != key:
                return None
            r = doc["report"]
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(r.get("probed_at", 0))))
            return AccelReport(
                Accel(r["accel"]),
                f"{r['reason']} (remembered from the probe of {when}; probing again)",
                float(r.get("seconds", 0.0)),
                float(r.get("probed_at", 0.0)),
                remembered=True,
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remember(self, key: dict[str, Any], report: AccelReport) -> None:
        if report.remembered:
            return  # only fresh answers
        entry = asdict(report)
        entry["accel"] = report.accel.value
        tmp = f"{self.path}.part"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "report": entry}, f, indent=2)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)
