"""Who may reach the fleet's files: QEMU, and no other local user.

QEMU runs as libvirt's qemu user (Debian: `libvirt-qemu`), and libvirt gives it the files of a
domain it starts (DAC relabelling: overlays, seeds, states, and their backing images). It must
still *traverse* the folders above them. Those folders are made `root:<qemu group> 0710` when
the server runs as root (QEMU traverses by group, nobody else can even look in), and `0711`
otherwise (traversable but not listable; the files themselves are 0600). A seed holds a one-time
enrollment token, a state a guest's whole memory: no local user may read either.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_QEMU_USER = "libvirt-qemu"
DEFAULT_QEMU_GROUP = "libvirt-qemu"


def qemu_gid(group: str | None = DEFAULT_QEMU_GROUP) -> int | None:
    """The group QEMU runs with, when this machine has it."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def guard_dir(path: str | os.PathLike[str], gid: int | None) -> int:
    """Make `path` (an existing folder) traversable by QEMU and closed to other users; returns
    the mode it got."""
    if gid is not None and os.geteuid() == 0:
        try:
            os.chown(path, 0, gid)
        except OSError as exc:
            log.warning("cannot give %s to group %d: %s", path, gid, exc)
        else:
            os.chmod(path, 0o710)
            return 0o710
    os.chmod(path, 0o711)
    return 0o711


def traversal_problem(path: Path, user: str = DEFAULT_QEMU_USER) -> str:
    """Why QEMU (running as `user`) cannot reach files below `path`, or "" when it can."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return ""  # no such user here (another distribution, a test machine): nothing to check
    gids = {pw.pw_gid, *(g.gr_gid for g in grp.getgrall() if user in g.gr_mem)}
    for folder in [path, *path.parents]:
        try:
            st = folder.stat()
        except FileNotFoundError:
            continue
        mode = st.st_mode
        if st.st_uid == pw.pw_uid and mode & stat.S_IXUSR:
            continue
        if st.st_gid in gids and mode & stat.S_IXGRP:
            continue
        if mode & stat.S_IXOTH:
            continue
        return (
            f"{folder} is not traversable by {user} (mode {oct(mode & 0o777)}, group "
            f"{st.st_gid}); QEMU cannot open instance disks below it — give it to group "
            f"{DEFAULT_QEMU_GROUP} with g+x (the server does so for its own folders when it "
            "runs as root), chmod o+x it, or choose another SANDBOX_DATA_DIR"
        )
    return ""
