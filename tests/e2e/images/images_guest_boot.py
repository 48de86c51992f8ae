"""Boot an image from `images` directly with QEMU (TCG) and watch its serial console.

Used by the e2e test and by tests/bench/bench_images.py. The guest gets a NoCloud seed ISO made
with pycdlib (volume id `cidata`), a static address with no route and no DNS, and user-mode
networking with restrict=on (it can reach nothing). QEMU is always killed.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pycdlib

RUNCMD_MARKER = "AGENTIC-E2E-RUNCMD-OK"
VENV_MARKER = "AGENTIC-E2E-VENV-OK"
FACTS_MARKER = "AGENTIC-E2E-FACTS"
CLOUD_INIT_DONE = re.compile(r"Cloud-init v\. \S+ finished at")

FACTS_SCRIPT = f"""#!/bin/sh
# Facts about the running clone, one line on the console (parsed by the test).
keys=$(ls /etc/ssh/ssh_host_*_key 2>/dev/null | wc -l)
addr=$(ip -4 -o addr show dev eth0 | awk '{{print $4}}' | head -n1)
routes=$(ip -4 route show default | wc -l)
echo "{FACTS_MARKER} machine_id=$(cat /etc/machine-id) host_keys=$keys \\
root=$(findmnt -no SOURCE /) fstype=$(findmnt -no FSTYPE /) label=$(findmnt -no LABEL /) \\
kernel=$(uname -r) resolv_bytes=$(wc -c < /etc/resolv.conf) hostname=$(hostname) \\
eth0=$addr default_routes=$routes locale=$LANG" > /dev/console
"""

USER_DATA = f"""#cloud-config
write_files:
  - path: /usr/local/sbin/e2e-facts
    permissions: "0755"
    content: |
{textwrap.indent(FACTS_SCRIPT, " " * 6)}
runcmd:
  - [sh, -c, 'echo {RUNCMD_MARKER} > /dev/console']
  - [sh, -c, '/opt/agentic-sandbox/venv/bin/python -c "import grpc, google.protobuf, ptyprocess; print(\\"{VENV_MARKER}\\", grpc.__version__)" > /dev/console 2>&1']
  - [/usr/local/sbin/e2e-facts]
"""  # noqa: E501


def make_seed_iso(path: Path, instance_id: str, hostname: str = "e2e-guest") -> None:
    """A NoCloud seed: user-data, meta-data, network-config (static, no route, no DNS)."""
    files = {
        "user-data": USER_DATA,
        "meta-data": f"instance-id: {instance_id}\nlocal-hostname: {hostname}\n",
        "network-config": (
            "version: 2\nethernets:\n  eth0:\n    dhcp4: false\n    addresses: [10.0.2.15/24]\n"
        ),
    }
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident="cidata")
    for i, (name, text) in enumerate(files.items()):
        data = text.encode()
        iso.add_fp(io.BytesIO(data), len(data), f"/FILE{i};1", rr_name=name, joliet_path=f"/{name}")
    iso.write(str(path))
    iso.close()


@dataclass
class BootResult:
    seconds_to: dict[str, float] = field(default_factory=dict)
    facts: dict[str, str] = field(default_factory=dict)
    venv_line: str = ""
    serial: str = ""
    timed_out: bool = False


def boot_until(
    *,
    base: Path,
    kernel: Path,
    initrd: Path,
    cmdline: str,
    workdir: Path,
    timeout: float = 240.0,
    memory_mib: int = 512,
    instance_id: str = "iid-e2e",
    extra_args: Sequence[str] = (),
    seed_on: str = "virtio",
) -> BootResult:
    """Boot a throwaway overlay of `base`; return when cloud-init is done (or on timeout).

    `seed_on`: `virtio` (a read-only virtio disk) or `ide-cdrom` (a CD-ROM on the i440fx IDE bus).
    """
    overlay = workdir / "overlay.qcow2"
    seed = workdir / "seed.iso"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(base), str(overlay)],
        check=True,
    )
    make_seed_iso(seed, instance_id)
    argv = [
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        "-m",
        str(memory_mib),
        "-smp",
        "1",
        "-nographic",
        "-no-reboot",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        cmdline,
        "-drive",
        f"file={overlay},if=virtio,format=qcow2",
        "-drive",
        f"file={seed},if=virtio,format=raw,readonly=on"
        if seed_on == "virtio"
        else f"file={seed},if=ide,media=cdrom,format=raw,readonly=on",
        "-netdev",
        "user,id=n0,restrict=on",
        "-device",
        "virtio-net-pci,netdev=n0",
        *extra_args,
    ]
    result = BootResult()
    lines: list[str] = []
    done = threading.Event()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").replace("\r", "")
            lines.append(line)
            now = round(time.monotonic() - t0, 2)
            if "login:" in line and "login_prompt" not in result.seconds_to:
                result.seconds_to["login_prompt"] = now
            if RUNCMD_MARKER in line and "echo" not in line:
                result.seconds_to.setdefault("runcmd", now)
            if VENV_MARKER in line and "print" not in line:
                result.venv_line = line.strip()
                result.seconds_to.setdefault("venv_import", now)
            if FACTS_MARKER in line and "$(" not in line:
                for m in re.finditer(r"(\w+)=(\S*)", line.split(FACTS_MARKER, 1)[1]):
                    result.facts[m.group(1)] = m.group(2)
            if CLOUD_INIT_DONE.search(line):
                result.seconds_to.setdefault("cloud_init_done", now)
                done.set()
        done.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if not done.wait(timeout):
            result.timed_out = True
        # give the last console lines a moment (they precede cloud-init's final message)
        time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        reader.join(timeout=10)
    result.serial = "".join(lines)
    (workdir / "serial.log").write_text(result.serial)
    return result
