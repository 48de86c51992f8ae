"""The SSH path into a guest: the server's own key, over the instance's loopback forward.

Used to diagnose a guest whose agent does not come home (its unit, its journal, cloud-init's
status). The forward binds 127.0.0.1 and leads to a VM this host just made, so the host key is
not pinned (it is new for every instance anyway).
"""

from __future__ import annotations

import os
from pathlib import Path

import asyncssh

# --merge: a clone's agent gives the guest a new machine-id, while journald keeps writing under
# the old one; plain journalctl would then say "No journal files were found".
DIAGNOSE_COMMAND = (
    "echo '## agent unit'; systemctl --no-pager --lines=0 status agentic-sandbox-agent.service; "
    "echo '## agent journal'; "
    "journalctl --merge --no-pager -n 80 -u agentic-sandbox-agent.service; "
    "echo '## cloud-init'; cloud-init status --long 2>&1 | tail -n 20"
)


def ensure_key(path: Path) -> str:
    """The server's SSH key (created 0600 on first use); returns the public key line."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="agentic-sandbox-server")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.export_private_key())
        path.with_suffix(".pub").write_bytes(key.export_public_key())
    key = asyncssh.read_private_key(str(path))
    return key.export_public_key().decode().strip()


async def run_in_guest(
    port: int, key_path: Path, command: str, *, user: str = "agent", seconds: float = 30.0
) -> str:
    async with asyncssh.connect(
        "127.0.0.1",
        port=port,
        username=user,
        client_keys=[str(key_path)],
        known_hosts=None,
        connect_timeout=seconds,
    ) as conn:
        result = await conn.run(command, check=False, timeout=seconds)
    out = result.stdout if isinstance(result.stdout, str) else ""
    err = result.stderr if isinstance(result.stderr, str) else ""
    return (out + err).strip()


async def diagnose(port: int, key_path: Path, seconds: float = 30.0) -> str:
    try:
        return "over SSH:\n" + await run_in_guest(port, key_path, DIAGNOSE_COMMAND, seconds=seconds)
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        return f"SSH to 127.0.0.1:{port} failed: {type(exc).__name__}: {exc}"
