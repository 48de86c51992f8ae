"""Hypervisor hosts in network namespaces the test makes: a private libvirtd (and virtlogd)
inside each, reached over the network as ``qemu+tcp://ADDR/system``.

    with NamespaceHypervisor("h1") as h:
        h.uri                    # qemu+tcp://198.18.N.2/system (the namespace's address)
        h.control_address        # 198.18.N.1: the host side of its veth, where its guests'
                                 # forwards lead (the gateway listens there)
        h.data_dir               # this host's own HostSpec.data_dir
        h.link(up=False)         # cut the link (host side), h.link(up=True) to restore it

    with NamespaceHypervisor("t", tls_dir=DIR) as h:   # also listen_tls (port 16514), with
        h.tls_uri                # DIR's cacert.pem, servercert.pem, serverkey.pem (the test's
                                 # CA); qemu+tls://198.18.N.2/system — tcp stays for clean-up

Addresses come from 198.18.0.0/15 (the benchmark range), a /30 per host chosen from the test
process's id; the namespace has no default route, no forwarding and no NAT, so nothing leaves
the veth pair. The daemon listens with ``listen_tcp`` and ``auth_tcp = "none"`` on the
namespace address only: a test network, never anything else. It has its own ``/run/libvirt``,
config, state, cache and log directories (bind-mounted in a mount namespace of its own, as
`PrivateLibvirtd` does), so no networks, pools or domains are shared with the machine's daemon;
QEMU is its child and so lives in the namespace too. `nsenter --net`, not ``ip netns exec``
(which remounts /sys and hides the cgroup tree from libvirtd).

Everything is removed on exit, also after a failure: domains and pools over the URI, QEMU by
its pid files, the daemons by their pids, then the namespace and the veth pair, then the files.
Needs root.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import libvirt

from tests.support.libvirt_daemons import DaemonUnavailable, PrivateLibvirtd, wait_uri
from tests.support.lifetime import die_with_parent
from tests.support.netns import NamespaceHost

NETWORK = "198.18"  # a /30 per host out of 198.18.0.0/16, inside its own namespace only
TCP_PORT = 16509
TLS_PORT = 16514


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int, timeout: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


class NamespaceHypervisor:
    def __init__(
        self, label: str, *, keepalive_interval: int = 2, tls_dir: Path | None = None
    ) -> None:
        self.label = label
        self.ns = NamespaceHost(label, network=NETWORK, tag="h")
        self.root = Path(tempfile.mkdtemp(prefix=f"sbx-nsh-{label}-", dir="/var/tmp"))
        os.chmod(self.root, 0o755)  # QEMU (libvirt-qemu) traverses it to the disks
        self.run_dir = self.root / "run"
        self.data_dir = str(self.root / "data")
        self.keepalive_interval = keepalive_interval
        self.tls_dir = tls_dir
        self.proc: subprocess.Popen[bytes] | None = None

    # ---- addresses --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The namespace's address: where its libvirtd listens."""
        return self.ns.address

    @property
    def control_address(self) -> str:
        """The host side of the veth: where this host's guests reach the control plane."""
        return self.ns.host_address

    @property
    def uri(self) -> str:
        return f"qemu+tcp://{self.address}/system"

    @property
    def tls_uri(self) -> str:
        """The TLS listener's URI (only with ``tls_dir``); the client names its pkipath."""
        return f"qemu+tls://{self.address}/system"

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> NamespaceHypervisor:
        try:
            self.ns.__enter__()
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _tls_lines(self) -> list[str]:
        if self.tls_dir is None:
            return ["listen_tls = 0"]
        d = self.tls_dir
        return [
            "listen_tls = 1",
            f'tls_port = "{TLS_PORT}"',
            f'ca_file = "{d / "cacert.pem"}"',
            f'cert_file = "{d / "servercert.pem"}"',
            f'key_file = "{d / "serverkey.pem"}"',
            "tls_no_verify_certificate = 0",  # a client must show a certificate from the CA
        ]

    def _config(self) -> Path:
        conf = self.root / "libvirtd.conf"
        conf.write_text(
            "\n".join(
                [
                    *self._tls_lines(),
                    "listen_tcp = 1",
                    f'listen_addr = "{self.address}"',
                    f'tcp_port = "{TCP_PORT}"',
                    'auth_tcp = "none"',  # a test network the test made: nothing else reaches it
                    'unix_sock_dir = "/run/libvirt"',
                    f"keepalive_interval = {self.keepalive_interval}",
                    "keepalive_count = 3",
                    f'log_outputs = "3:file:{self.root / "libvirtd.log"}"',
                    "",
                ]
            )
        )
        return conf

    def start(self) -> None:
        """Start (or restart) the namespace's libvirtd; its guests keep running across it."""
        self.run_dir.mkdir(exist_ok=True)
        Path(self.data_dir).mkdir(exist_ok=True)
        os.chmod(self.data_dir, 0o755)
        q = shlex.quote
        lines = [
            "set -e",
            "mount --make-rprivate /",
            f"mount --bind {q(str(self.run_dir))} /run/libvirt",
        ]
        for name, target in PrivateLibvirtd.PRIVATE.items():
            d = self.root / name
            d.mkdir(exist_ok=True)
            if os.path.isdir(target):
                lines.append(f"mount --bind {q(str(d))} {q(target)}")
        vl_pid = self.root / "virtlogd.pid"
        if _pid(vl_pid) is None:
            lines.append(f"virtlogd -d -p {q(str(vl_pid))}")
        lines.append(
            f"exec libvirtd --listen -f {q(str(self._config()))} "
            f"-p {q(str(self.root / 'libvirtd.pid'))}"
        )
        log = open(self.root / "libvirtd.out", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{self.ns.name}",
                "--",
                "unshare",
                "-m",
                "sh",
                "-c",
                "\n".join(lines),
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        log.close()
        try:
            wait_uri(self.uri, timeout=30)
        except DaemonUnavailable as e:
            out = (self.root / "libvirtd.out").read_text(errors="replace")[-2000:]
            raise DaemonUnavailable(f"{e}\n{out}") from e

    def stop(self) -> None:
        """Stop the daemon only (its guests keep running, as on a real daemon restart)."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def link(self, *, up: bool) -> None:
        """Cut or restore the link, on the host side (the route goes with it, so connection
        attempts fail at once instead of waiting on SYNs)."""
        subprocess.run(
            ["ip", "link", "set", self.ns.host_if, "up" if up else "down"],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def listening(self) -> list[str]:
        """The TCP addresses listened on inside the namespace (``ss -ltnH``)."""
        out = subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.ns.name}", "--", "ss", "-ltnH"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return sorted(line.split()[3] for line in out.splitlines() if line.strip())

    def _destroy_domains_and_pools(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(libvirt.libvirtError):
            self.link(up=True)
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

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._destroy_domains_and_pools()
        for pidfile in (self.run_dir / "qemu").glob("*.pid"):  # whatever is left of QEMU
            pid = _pid(pidfile)
            if pid is not None:
                _kill(pid)
        self.stop()
        for pidfile in (self.root / "libvirtd.pid", self.root / "virtlogd.pid"):
            pid = _pid(pidfile)
            if pid is not None:
                _kill(pid)
        self.ns.close()
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.root)], timeout=60)

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for name in ("libvirtd.out", "libvirtd.log"):
            with contextlib.suppress(OSError):
                parts.append((self.root / name).read_text(errors="replace")[-chars:])
        return "\n".join(parts)
