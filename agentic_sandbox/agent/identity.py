"""Who this guest is, read from its cloud-init seed; and taking on a new identity when it changes.

A guest restored from a saved memory state (a clone, or a warm-pool hand-off) wakes up as the
guest it was saved from: same machine-id, SSH host keys, hostname, agent certificate, and a clock
that lags. Provisioning gives the clone a new seed (`agentic-sandbox.json` on the `cidata` disk)
naming its instance id and a fresh enrollment token. The agent reads the seed when it starts
and before every reconnect; when the instance id differs from its own it refreshes the guest's
identity (machine-id, SSH host keys, hostname), forgets the old instance's sessions and
certificate, and enrolls as the new instance. It never connects under the old identity.

Only the standard library: this runs inside the guest.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agentic_sandbox.proto import seed_record

log = logging.getLogger(__name__)

SEED_LABEL = "cidata"
IDENTITY_FILE = "agentic-sandbox.json"
CANDIDATES = ("/dev/disk/by-label/cidata", "/dev/sr0", "/dev/sr1", "/dev/vdb")


@dataclass(frozen=True)
class SeedIdentity:
    instance_id: str
    hostname: str
    server: str
    enroll_server: str
    server_name: str
    gateway: str
    ca_pem: str
    enrollment_token: str
    issued_at: float
    entropy: bytes = b""  # random bytes made on the host for this incarnation (`entropy.py`)
    # a warm-pool member's seed: no instance yet, only a key to make ahead (`seed_record`)
    standby: bool = False
    # a hand-off's seed: the pool member it is for, which may use the key it made standing by
    # (only the record in the seed's system area carries it; a clone's seed never does)
    standby_of: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SeedIdentity:
        return cls(
            instance_id=str(data["instance_id"]),
            hostname=str(data.get("hostname") or data["instance_id"]),
            server=str(data.get("server", "")),
            enroll_server=str(data.get("enroll_server", "")),
            gateway=str(data.get("gateway", "")),
            server_name=str(data.get("server_name", "")),
            ca_pem=str(data.get("ca_pem", "")),
            enrollment_token=str(data.get("enrollment_token", "")),
            issued_at=float(data.get("issued_at", 0)),
            entropy=_entropy(data.get("entropy")),
            standby=data.get("standby") is True,
            standby_of=_member(data.get("standby_of")),
        )


def _member(value: Any) -> str:
    """The seed's `standby_of`: a pool member's id, or nothing when it is not one."""
    return value if isinstance(value, str) and 0 < len(value) <= 128 else ""


def _entropy(value: Any) -> bytes:
    """The seed's `entropy` (base64), or nothing when it is missing or not base64."""
    if not isinstance(value, str) or len(value) > 1024:
        return b""
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        return b""


def _run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def _seed_devices() -> Iterator[str]:
    """Where the seed may be: the usual devices first (no process to start: this runs on every
    seed change, inside an emulated guest), then, only if none of them held it, whatever `blkid`
    finds labelled `cidata`."""
    seen: list[str] = []
    for dev in CANDIDATES:
        real = os.path.realpath(dev)
        if os.path.exists(real) and real not in seen:
            seen.append(real)
            yield real
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        res = _run("blkid", "-L", SEED_LABEL, timeout=10)
        dev = os.path.realpath(res.stdout.strip()) if res.returncode == 0 else ""
        if dev and dev not in seen:
            yield dev


def unlock_cdrom_trays() -> None:
    """Opening the CD-ROM to read the seed must not lock its tray: the host swaps the seed
    (clones, warm-pool hand-offs) with a media change, which a locked tray delays."""
    with contextlib.suppress(OSError):
        Path("/proc/sys/dev/cdrom/lock").write_text("0\n")


HEAD_BYTES = 64 * 1024  # what one direct read of the seed disk takes: its system area and more


@dataclass(frozen=True)
class SeedHead:
    """The first bytes of the seed disk: a fingerprint to notice a new seed by, and the
    identity when the seed carries it in its system area (`proto/seed_record.py`)."""

    fingerprint: bytes
    identity: SeedIdentity | None


def parse_head(head: bytes, known: bytes | None = None) -> SeedHead:
    """The fingerprint of `head` and the identity its record holds; when the fingerprint is
    `known` (the seed already read) the record is not parsed again (identity None)."""
    import hashlib

    fingerprint = hashlib.sha256(head).digest()
    if fingerprint == known:
        return SeedHead(fingerprint, None)
    found: SeedIdentity | None = None
    payload = seed_record.unpack(head)
    if payload is not None:
        try:
            found = SeedIdentity.from_json(json.loads(payload))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable identity record on the seed: %s", exc)
    return SeedHead(fingerprint, found)


def read_seed_head(known: bytes | None = None) -> SeedHead | None:
    """The seed disk's first 64 KiB, read past the page cache (O_DIRECT: a restored guest's
    cache may hold the previous seed's blocks) in one read: a new seed is noticed, and on a
    seed that carries its record, read, without mounting anything (10-20 ms in a TCG guest
    against about 0.6 s for `read_seed`). `known`: see `parse_head`."""
    import mmap

    for dev in CANDIDATES:
        if not os.path.exists(dev):
            continue
        try:
            fd = os.open(os.path.realpath(dev), os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            continue
        try:
            buf = mmap.mmap(-1, HEAD_BYTES)  # page-aligned, as O_DIRECT wants
            try:
                n = os.readv(fd, [buf])
                return parse_head(buf[:n], known)
            finally:
                buf.close()
        except OSError:
            continue
        finally:
            os.close(fd)
    return None


def read_seed() -> SeedIdentity | None:
    """The identity file on the seed disk, read fresh (kernel buffers dropped first: a restored
    guest's page cache may still hold the previous seed's blocks); for a seed without the
    system-area record (one made by an older server)."""
    if os.geteuid() != 0:
        return None
    for real in _seed_devices():  # lazily: blkid runs only when the usual devices fail
        seed = _read_seed_from(real)
        if seed is not None:
            return seed
    return None


def _read_seed_from(real: str) -> SeedIdentity | None:
    _run("blockdev", "--flushbufs", real, timeout=10)
    with tempfile.TemporaryDirectory(prefix="sbx-seed-") as mnt:
        res = _run("mount", "-o", "ro", real, mnt, timeout=20)
        if res.returncode != 0:
            return None
        try:
            path = Path(mnt) / IDENTITY_FILE
            if not path.exists():
                return None
            return SeedIdentity.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("unreadable %s on %s: %s", IDENTITY_FILE, real, exc)
            return None
        finally:
            _run("umount", mnt, timeout=20)


def refresh_guest_identity(seed: SeedIdentity, *, ssh_keys: bool = True) -> None:
    """Give this guest its own machine-id and hostname, and (unless `ssh_keys` is False; then
    call `refresh_ssh_host_keys` yourself) its own SSH host keys. Root only."""
    machine_id = secrets.token_hex(16)
    Path("/etc/machine-id").write_text(machine_id + "\n")
    dbus_id = Path("/var/lib/dbus/machine-id")
    if dbus_id.exists() and not dbus_id.is_symlink():
        dbus_id.write_text(machine_id + "\n")
    Path("/etc/hostname").write_text(seed.hostname + "\n")
    with contextlib.suppress(OSError):
        socket.sethostname(seed.hostname)
    hosts = Path("/etc/hosts")
    with contextlib.suppress(OSError):
        lines = [ln for ln in hosts.read_text().splitlines() if not ln.startswith("127.0.1.1")]
        lines.append(f"127.0.1.1 {seed.hostname}")
        hosts.write_text("\n".join(lines) + "\n")
    if ssh_keys:
        refresh_ssh_host_keys()
    log.info("guest identity refreshed for %s (machine-id, hostname)", seed.hostname)


def refresh_ssh_host_keys() -> None:
    """New SSH host keys (the clone's are its source's), then restart sshd."""
    ssh = Path("/etc/ssh")
    if not ssh.is_dir():
        return
    for key in ssh.glob("ssh_host_*"):
        key.unlink(missing_ok=True)
    for kind in ("ed25519", "ecdsa"):
        _run("ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(ssh / f"ssh_host_{kind}_key"))
    _run("systemctl", "try-restart", "ssh.service", timeout=30)
    log.info("SSH host keys regenerated")


class Clock(Protocol):
    """The realtime clock `step_clock` reads and sets (tests drive it without root)."""

    def now(self) -> float: ...

    def may_set(self) -> bool: ...

    def set(self, unix_time: float) -> None: ...


class SystemClock:
    """The machine's CLOCK_REALTIME; only root may set it."""

    def now(self) -> float:
        return time.time()

    def may_set(self) -> bool:
        return os.geteuid() == 0

    def set(self, unix_time: float) -> None:
        time.clock_settime(time.CLOCK_REALTIME, unix_time)


SYSTEM_CLOCK = SystemClock()


def step_clock(server_time: float, tolerance: float = 2.0, clock: Clock = SYSTEM_CLOCK) -> bool:
    """Set the clock to the server's when it is off by more than `tolerance` seconds (a restored
    guest's clock lags by the time it spent saved). Root only; returns whether it stepped."""
    if not clock.may_set() or abs(clock.now() - server_time) <= tolerance:
        return False
    try:
        clock.set(server_time)
    except OSError as exc:
        log.warning("cannot set the clock: %s", exc)
        return False
    log.info("clock stepped to the server's time")
    return True
