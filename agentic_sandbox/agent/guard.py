"""The guest firewall that keeps the agent's forward the agent's own.

A guest reaches the control plane through one forward (10.0.2.2:<port>) whose host side
carries one connection at a time: any process that could open it could cut the agent's link,
or talk over it. The agent (root) installs an nftables rule that refuses connections to the
forward from every user but root, each time it starts (the rule lives in the kernel; a memory
clone keeps it). A guest whose loadout grants sudo can lift it — sudo is root.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger("agent")

TABLE = "agentic_sandbox_link"


def rules(host: str, port: int) -> str:
    # "add table" then "delete table" makes the load idempotent (nft has no "replace").
    return (
        f"add table inet {TABLE}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        "  chain output {\n"
        "    type filter hook output priority 0; policy accept;\n"
        f"    ip daddr {host} tcp dport {port} meta skuid != 0 counter reject with tcp reset\n"
        "  }\n"
        "}\n"
    )


def guard_forward(address: str) -> str | None:
    """Only root may connect to `address` (HOST:PORT) from now on; the problem, if it could not
    be done."""
    host, _, port = address.rpartition(":")
    if os.geteuid() != 0:
        return "the agent does not run as root: the link's forward is not guarded"
    nft = shutil.which("nft")
    if nft is None:
        return "nft (nftables) is not installed: the link's forward is not guarded"
    try:
        res = subprocess.run(
            [nft, "-f", "-"],
            input=rules(host, int(port)),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nft could not run: {exc}"
    if res.returncode != 0:
        return f"nft refused the rule: {res.stderr.strip()[-300:]}"
    log.info("the link's forward %s is open to root only", address)
    return None
