"""A tiny bootable test guest: Debian's cloud kernel + a busybox initramfs.

The guest's ``/init`` prints ``SBX-BOOT-MARKER`` on the serial console, optionally probes TCP
ports (``sbx.probe=[HOST:]PORT[,...]`` on the kernel command line, HOST defaulting to
10.0.2.2, the guest forward's address; results printed as ``SBX-PROBE <port> ok|fail``), then
prints ``SBX-TICK <n>`` ten times a second forever. The counter lives in guest memory, so a
memory snapshot/restore is visible as the counter resuming from the saved value.

Artifacts are cached under ``$SANDBOX_TEST_CACHE`` (default
``/var/tmp/agentic-sandbox-test-cache``); rebuilding takes well under a second once the kernel
package is installed (``apt-get install linux-image-cloud-amd64 busybox-static``).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = "/var/tmp/agentic-sandbox-test-cache"
BOOT_MARKER = "SBX-BOOT-MARKER"
TICK = "SBX-TICK"
BUSYBOX = "/bin/busybox"
# Modules needed for the virtio NIC, in load order.
NET_MODULES = (
    "kernel/net/core/failover.ko",
    "kernel/drivers/net/net_failover.ko",
    "kernel/drivers/virtio/virtio_ring.ko",
    "kernel/drivers/virtio/virtio.ko",
    "kernel/drivers/virtio/virtio_pci_modern_dev.ko",
    "kernel/drivers/virtio/virtio_pci_legacy_dev.ko",
    "kernel/drivers/virtio/virtio_pci.ko",
    "kernel/drivers/net/virtio_net.ko",
)

INIT_SCRIPT = """#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev 2>/dev/null
echo "SBX-BOOT-MARKER"
for m in failover net_failover virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev \\
         virtio_pci virtio_net; do
  insmod /lib/modules/$m.ko 2>/dev/null
done
ip link set lo up
if ip link show eth0 >/dev/null 2>&1; then
  ip addr add 10.0.2.15/24 dev eth0
  ip link set eth0 up
fi
probe=""
for w in $(cat /proc/cmdline); do
  case "$w" in sbx.probe=*) probe="${w#sbx.probe=}" ;; esac
done
sleep 1
for p in $(echo "$probe" | tr ',' ' '); do
  case "$p" in *:*) h="${p%:*}"; p="${p##*:}" ;; *) h=10.0.2.2 ;; esac
  out=$(echo "hello-from-guest" | timeout 3 nc "$h" "$p" 2>/dev/null)
  if [ -n "$out" ]; then
    echo "SBX-PROBE $p ok"
  else
    echo "SBX-PROBE $p fail"
  fi
done
i=0
while true; do
  echo "SBX-TICK $i"
  i=$((i+1))
  usleep 100000
done
"""


@dataclass(frozen=True)
class TinyGuest:
    kernel: Path
    initrd: Path
    base_disk: Path
    cmdline: str = "console=ttyS0 quiet panic=-1"


class TinyGuestUnavailable(RuntimeError):
    """The machine lacks what the tiny guest needs (kernel package, busybox)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SANDBOX_TEST_CACHE", DEFAULT_CACHE))


def _find_kernel() -> tuple[Path, str]:
    kernels = sorted(glob.glob("/boot/vmlinuz-*-cloud-amd64")) or sorted(
        glob.glob("/boot/vmlinuz-*")
    )
    if not kernels:
        raise TinyGuestUnavailable(
            "no kernel in /boot: install one with `apt-get install linux-image-cloud-amd64`"
        )
    k = Path(kernels[-1])
    return k, k.name.removeprefix("vmlinuz-")


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A gzip'd cpio 'newc' archive of (name, mode, data) entries."""
    out = io.BytesIO()

    def pad4() -> None:
        out.write(b"\0" * ((4 - out.tell() % 4) % 4))

    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        nb = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0]
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields))
        out.write(nb)
        pad4()
        out.write(data)
        pad4()
    return gzip.compress(out.getvalue(), compresslevel=1, mtime=0)


def build(dest: Path | None = None) -> TinyGuest:
    """Build (or reuse from cache) the tiny guest. Raises TinyGuestUnavailable with a reason."""
    kernel_src, release = _find_kernel()
    if not os.path.exists(BUSYBOX):
        raise TinyGuestUnavailable("no /bin/busybox: `apt-get install busybox-static`")
    moddir = Path("/lib/modules") / release
    h = hashlib.sha256()
    h.update(INIT_SCRIPT.encode())
    h.update(release.encode())
    h.update(str(os.stat(BUSYBOX).st_size).encode())
    key = h.hexdigest()[:16]
    root = (dest or cache_dir()) / f"tiny-guest-{key}"
    guest = TinyGuest(root / "vmlinuz", root / "initrd.gz", root / "base.qcow2")
    if all(p.exists() for p in (guest.kernel, guest.initrd, guest.base_disk)):
        return guest
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    os.chmod(tmp, 0o755)
    for p in (tmp.parent,):
        os.chmod(p, 0o755)
    shutil.copyfile(kernel_src, tmp / "vmlinuz")
    entries: list[tuple[str, int, bytes]] = []
    for d in ("bin", "sbin", "proc", "sys", "dev", "tmp", "lib", "lib/modules", "usr", "usr/bin"):
        entries.append((d, 0o040755, b""))
    entries.append(("bin/busybox", 0o100755, Path(BUSYBOX).read_bytes()))
    applets = (
        "sh",
        "mount",
        "insmod",
        "ip",
        "nc",
        "sleep",
        "cat",
        "tr",
        "timeout",
        "echo",
        "usleep",
    )
    for applet in applets:
        entries.append((f"bin/{applet}", 0o120777, b"busybox"))
    for rel in NET_MODULES:
        src = moddir / rel
        if src.exists():
            entries.append((f"lib/modules/{src.name}", 0o100644, src.read_bytes()))
    entries.append(("init", 0o100755, INIT_SCRIPT.encode()))
    (tmp / "initrd.gz").write_bytes(_cpio_newc(entries))
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(tmp / "base.qcow2"), "64M"], check=True
    )
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if root.exists():
        shutil.rmtree(root)
    os.rename(tmp, root)
    return guest
