"""Customization of a debootstrapped root filesystem into a cloud-init ready, clonable guest.

Everything here is plain file work on a directory (no chroot, no subprocess), so it is testable
on a fake tree. The builder runs the chroot steps (systemctl enable, recipe commands, the venv).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from agentic_sandbox.images.recipe import Recipe

CLOUD_CFG_NAME = "90_agentic_sandbox.cfg"

#: Cloud-init settings every image gets; recipe `customize.cloud_init` keys override them.
BASE_CLOUD_CONFIG: dict[str, Any] = {
    "datasource_list": ["NoCloud", "None"],
    "manage_etc_hosts": True,
    "preserve_hostname": False,
    # RSA-3072 host key generation takes ~7 s of a TCG guest's first boot; ed25519 and ECDSA are
    # near-instant and every current SSH client speaks them.
    "ssh_genkeytypes": ["ed25519", "ecdsa"],
    # Images boot their kernel directly and carry no GRUB; its debconf step costs ~3 s of boot.
    "grub_dpkg": {"enabled": False},
    "system_info": {"network": {"renderers": ["networkd"], "activators": ["networkd"]}},
}

SSH_KEYGEN_DROPIN = """\
# agentic-sandbox: images carry no SSH host keys (each clone makes its own). cloud-init's ssh
# module normally creates them first; this covers boots where it did not (or keys were wiped
# by an identity refresh): without any host key, make an ed25519 one (fast even under TCG).
[Unit]
After=cloud-init.service
[Service]
ExecStartPre=/bin/sh -c 'ls /etc/ssh/ssh_host_*_key >/dev/null 2>&1 || \
 /usr/bin/ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/ssh_host_ed25519_key'
"""

WAIT_ONLINE_DROPIN = """\
# agentic-sandbox: never hold the boot for minutes when a guest has no network (isolated
# guests, no DHCP): the first link up is enough, and give up after 20 s.
[Service]
ExecStart=
ExecStart=/lib/systemd/systemd-networkd-wait-online --any --timeout=20
"""

#: cloud-init names the guest's network file after the interface (the image boots with
#: net.ifnames=0, so it is eth0); a drop-in beside it applies whatever network-config says.
NETWORK_DROPIN_PATH = "/etc/systemd/network/10-cloud-init-eth0.network.d/90-agentic-no-ra.conf"
NO_RA_DROPIN = """\
# agentic-sandbox: guests take no IPv6 router advertisements. Isolated guests must be handed no
# route, and with RA accepted on a static link that no router answers, systemd-networkd holds
# the link "configuring" through its solicitations: ~12 s of every boot, before cloud-init's
# network stage. (cloud-init 22.4 renders `accept-ra` only for DHCPv6 links.) NAT guests get
# IPv4 from user-mode networking's DHCP.
[Network]
IPv6AcceptRA=no
"""

#: No password logins over SSH, from the first boot on (rather than cloud-init's `ssh_pwauth`,
#: which rewrites sshd_config and restarts sshd: ~3 s of an emulated boot).
SSHD_NO_PASSWORDS = """\
# agentic-sandbox: keys only
PasswordAuthentication no
KbdInteractiveAuthentication no
"""

NO_APT_PERIODIC = """\
// agentic-sandbox: no background apt activity in guests.
APT::Periodic::Enable "0";
APT::Periodic::Update-Package-Lists "0";
APT::Periodic::Unattended-Upgrade "0";
"""


def _write(root: Path, guest_path: str, content: str, mode: int = 0o644) -> Path:
    target = guest(root, guest_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        target.unlink()
    target.write_text(content, encoding="utf-8")
    os.chmod(target, mode)
    return target


def guest(root: Path, guest_path: str) -> Path:
    """Host path of `guest_path` inside `root`, refusing anything that escapes it lexically."""
    rel = guest_path.lstrip("/")
    candidate = Path(os.path.normpath(root / rel))
    if candidate != root and root not in candidate.parents:
        raise ValueError(f"{guest_path!r} escapes the root filesystem")
    # Refuse to follow a symlinked parent out of the tree (a guest symlink is relative to the
    # guest root, not the host's).
    parent = candidate.parent
    while parent != root and root in parent.parents:
        if parent.is_symlink():
            raise ValueError(f"{guest_path!r}: parent {parent} is a symlink")
        parent = parent.parent
    return candidate


def cloud_config(recipe: Recipe) -> dict[str, Any]:
    """The cloud.cfg.d snippet: base settings, the recipe's locale, then recipe overrides."""
    cfg: dict[str, Any] = {**BASE_CLOUD_CONFIG, "locale": recipe.customize.locale}
    for key, value in recipe.customize.cloud_init.items():
        cfg[key] = value
    return cfg


def mask_units(root: Path, units: list[str]) -> None:
    """Link each unit to /dev/null in /etc/systemd/system and drop its enablement links."""
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True, exist_ok=True)
    for unit in units:
        for link in etc.glob(f"*.wants/{unit}"):
            link.unlink()
        target = etc / unit
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to("/dev/null")


def remove_identity(root: Path) -> None:
    """Strip per-machine identity: machine-id, SSH host keys, cloud-init state, random seed."""
    _write(root, "/etc/machine-id", "", 0o444)
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
    if dbus_id.parent.is_dir():
        dbus_id.symlink_to("/etc/machine-id")
    for key in glob.glob(str(root / "etc/ssh/ssh_host_*")):
        os.unlink(key)
    for stale in (
        "var/lib/cloud",
        "var/lib/systemd/random-seed",
        "var/lib/systemd/credential.secret",
    ):
        p = root / stale
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def clean_caches(root: Path) -> None:
    """Drop apt lists and archives, logs, temp files: they are bulk without value in a base."""
    for pattern in (
        "var/cache/apt/archives/*.deb",
        "var/cache/apt/*.bin",
        "var/lib/apt/lists/*_*",
        "var/cache/debconf/*-old",
        "var/lib/dpkg/*-old",
        "tmp/*",
        "var/tmp/*",
        "root/.cache",
        "var/log/cloud-init*",
        "var/log/bootstrap.log",
    ):
        for p in glob.glob(str(root / pattern)):
            path = Path(p)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for log in (
        "var/log/dpkg.log",
        "var/log/alternatives.log",
        "var/log/apt/history.log",
        "var/log/apt/term.log",
        "var/log/apt/eipp.log.xz",
    ):
        logfile = root / log
        if logfile.is_file() and not logfile.is_symlink():
            logfile.write_bytes(b"")
    # Leftover python bytecode from the host-side steps is regenerated by the guest as needed.
    for p in glob.glob(str(root / "root/.*_history")):
        os.unlink(p)


def customize_tree(root: Path, recipe: Recipe) -> None:
    """Apply every file-level customization of the recipe to `root` (idempotent)."""
    c = recipe.customize
    _write(root, "/etc/hostname", c.hostname + "\n")
    _write(
        root,
        "/etc/hosts",
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{c.hostname}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\n"
        "ff02::2\tip6-allrouters\n",
    )
    # An empty resolv.conf: the build host's must never leak into guests.
    _write(root, "/etc/resolv.conf", "")
    _write(
        root,
        "/etc/fstab",
        f"# agentic-sandbox: root by label (the disk has no partition table)\n"
        f"LABEL={recipe.disk.root_label}\t/\t{recipe.disk.filesystem}\t"
        "defaults,errors=remount-ro\t0\t1\n",
    )
    _write(root, "/etc/default/locale", f"LANG={c.locale}\n")
    _write(root, "/etc/timezone", c.timezone + "\n")
    localtime = root / "etc/localtime"
    if localtime.exists() or localtime.is_symlink():
        localtime.unlink()
    localtime.symlink_to(f"/usr/share/zoneinfo/{c.timezone}")
    _write(
        root,
        f"/etc/cloud/cloud.cfg.d/{CLOUD_CFG_NAME}",
        "# agentic-sandbox image defaults (generated from the recipe)\n"
        + yaml.safe_dump(cloud_config(recipe), sort_keys=True, default_flow_style=None),
    )
    _write(root, "/etc/systemd/system/ssh.service.d/10-agentic-host-keys.conf", SSH_KEYGEN_DROPIN)
    _write(
        root,
        "/etc/systemd/system/systemd-networkd-wait-online.service.d/10-agentic-timeout.conf",
        WAIT_ONLINE_DROPIN,
    )
    _write(root, NETWORK_DROPIN_PATH, NO_RA_DROPIN)
    _write(root, "/etc/ssh/sshd_config.d/10-agentic-keys-only.conf", SSHD_NO_PASSWORDS)
    _write(root, "/etc/apt/apt.conf.d/10agentic-no-periodic", NO_APT_PERIODIC)
    mask_units(root, list(c.mask_units))
    for f in c.files:
        _write(root, f.path, f.content, int(f.mode, 8))
    remove_identity(root)


def seal_tree(root: Path) -> None:
    """Final pass after every chroot step: identity out, caches out, resolv.conf empty."""
    _write(root, "/etc/resolv.conf", "")
    remove_identity(root)
    clean_caches(root)
    for d in ("proc", "sys", "dev/pts", "run", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(root / "tmp", 0o1777)


def tree_usage(root: Path) -> tuple[int, int]:
    """(bytes as 4 KiB blocks, number of inodes) that `root` needs on ext4, without crossing
    into other filesystems."""
    top_dev = os.lstat(root).st_dev
    blocks = 0
    inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == top_dev]
        inodes += 1
        blocks += 1
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            if st.st_nlink > 1:
                seen.add(key)
            inodes += 1
            if st.st_size > 60 or not os.path.islink(os.path.join(dirpath, name)):
                blocks += (st.st_size + 4095) // 4096
    return blocks * 4096, inodes


def kernel_files(root: Path) -> tuple[Path, Path, str]:
    """(vmlinuz, initrd, version) from the rootfs's /boot: the newest kernel with an initrd."""
    boot = root / "boot"
    found: list[tuple[str, Path, Path]] = []
    for vmlinuz in boot.glob("vmlinuz-*"):
        version = vmlinuz.name[len("vmlinuz-") :]
        initrd = boot / f"initrd.img-{version}"
        if initrd.is_file():
            found.append((version, vmlinuz, initrd))
    if not found:
        raise FileNotFoundError(f"no vmlinuz-*/initrd.img-* pair in {boot}")
    found.sort(key=lambda t: _version_key(t[0]))
    version, vmlinuz, initrd = found[-1]
    return vmlinuz, initrd, version


def _version_key(v: str) -> list[tuple[int, str]]:
    parts: list[tuple[int, str]] = []
    for piece in v.replace("-", ".").split("."):
        parts.append((int(piece), "") if piece.isdigit() else (-1, piece))
    return parts


def read_accounts(root: Path) -> tuple[list[str], list[str]]:
    """(users as `name:uid`, groups as `name:gid`) from the tree's passwd and group files."""

    def parse(path: Path) -> list[str]:
        out = []
        with contextlib.suppress(OSError):
            for line in path.read_text(encoding="utf-8").splitlines():
                parts = line.split(":")
                if len(parts) >= 3 and parts[0]:
                    out.append(f"{parts[0]}:{parts[2]}")
        return out

    return parse(root / "etc/passwd"), parse(root / "etc/group")
