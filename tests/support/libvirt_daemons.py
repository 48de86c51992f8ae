"""libvirt daemons for the real tier: the machine's own, and a private second one.

There is no systemd here: the tests start ``virtlogd -d``/``libvirtd -d`` themselves when they are
not running. `PrivateLibvirtd` runs a second, independent libvirtd in its own mount namespace
(``unshare -m``) with its own ``/run/libvirt`` (a directory under the test's root, bind-mounted, so
its socket is reachable from outside as ``qemu+unix:///system?socket=…``) and its own config and
state directories, so it shares no domains, pools or networks with the main daemon. Its
QEMU processes survive a restart of that daemon, like the real thing.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import libvirt

MAIN_URI = "qemu:///system"


class DaemonUnavailable(RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _pidfile(path: str | Path) -> int | None:
    try:
        pid = int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def wait_uri(uri: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            libvirt.open(uri).close()
            return
        except libvirt.libvirtError as e:
            last = str(e)
        time.sleep(0.1)
    raise DaemonUnavailable(f"libvirt at {uri} did not answer within {timeout:.0f}s: {last}")


def ensure_main_libvirtd() -> None:
    """Start virtlogd/libvirtd when they are not running (no systemd on these machines)."""
    for binary in ("libvirtd", "virtlogd", "qemu-system-x86_64", "qemu-img"):
        if shutil.which(binary) is None:
            raise DaemonUnavailable(
                f"{binary} is not installed: apt-get install qemu-system-x86 qemu-utils "
                "libvirt-daemon-system"
            )
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    if _pidfile("/run/virtlogd.pid") is None:
        subprocess.run(["virtlogd", "-d"], check=True)
    if _pidfile("/run/libvirtd.pid") is None:
        subprocess.run(["libvirtd", "-d"], check=True)
    wait_uri(MAIN_URI)


def restart_main_libvirtd() -> None:
    pid = _pidfile("/run/libvirtd.pid")
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    subprocess.run(["libvirtd", "-d"], check=True)
    wait_uri(MAIN_URI)


class PrivateLibvirtd:
    """A second libvirtd acting as another hypervisor host."""

    PRIVATE = {
        "etc-qemu": "/etc/libvirt/qemu",
        "etc-storage": "/etc/libvirt/storage",
        "etc-secrets": "/etc/libvirt/secrets",
        "lib-qemu": "/var/lib/libvirt/qemu",
        "cache-qemu": "/var/cache/libvirt/qemu",
        "log-qemu": "/var/log/libvirt/qemu",
    }

    def __init__(self, root: Path) -> None:
        self.root = root
        self.run_dir = root / "run"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.run_dir}/libvirt-sock"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(exist_ok=True)
        lines = [
            "set -e",
            "mount --make-rprivate /",
            f"mount --bind {shlex.quote(str(self.run_dir))} /run/libvirt",
        ]
        for name, target in self.PRIVATE.items():
            d = self.root / name
            d.mkdir(exist_ok=True)
            if os.path.isdir(target):
                lines.append(f"mount --bind {shlex.quote(str(d))} {shlex.quote(target)}")
        vl_pid = self.root / "virtlogd.pid"
        if _pidfile(vl_pid) is None:
            lines.append(f"virtlogd -d -p {shlex.quote(str(vl_pid))}")
        lines.append(f"exec libvirtd -p {shlex.quote(str(self.root / 'libvirtd.pid'))}")
        log = open(self.root / "libvirtd.out", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", "\n".join(lines)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        try:
            wait_uri(self.uri)
        except DaemonUnavailable as e:
            out = (self.root / "libvirtd.out").read_text(errors="replace")[-2000:]
            self.stop()
            raise DaemonUnavailable(f"{e}\n{out}") from e

    def stop(self) -> None:
        """Stop the daemon (its guests keep running, as with a real daemon restart)."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def destroy_everything(self) -> None:
        """Remove every domain and pool of this daemon, stop it and its virtlogd."""
        with contextlib.suppress(libvirt.libvirtError, DaemonUnavailable):
            if self.proc is None:
                self.start()
            conn = libvirt.open(self.uri)
            for dom in conn.listAllDomains(0):
                with contextlib.suppress(libvirt.libvirtError):
                    if dom.isActive():
                        dom.destroy()
                with contextlib.suppress(libvirt.libvirtError):
                    dom.undefineFlags(
                        libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                        | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                    )
            for pool in conn.listAllStoragePools(0):
                with contextlib.suppress(libvirt.libvirtError):
                    if pool.isActive():
                        pool.destroy()
                with contextlib.suppress(libvirt.libvirtError):
                    pool.undefine()
            conn.close()
        self.stop()
        pid = _pidfile(self.root / "virtlogd.pid")
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
