"""The guest firewall that keeps the agent's way out the agent's own.

A guest reaches the control plane through one forward (10.0.2.2:<port>) whose host side
carries one connection at a time — or through the agent's loopback bridge to the link's
virtio-serial port, which behaves the same (`serial_link.py`): any process that could open either
could cut the agent's link, or talk over it. The agent (root) installs nftables rules that
refuse connections to both from every user but root, each time it starts (the rules live in
the kernel; a memory clone keeps them). A guest whose loadout grants sudo can lift them — sudo
is root.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger("agent")

TABLE = "agentic_sandbox_link"


def rules(addresses: list[tuple[str, int]]) -> str:
    # "add table" then "delete table" makes the load idempotent (nft has no "replace").
    refuse = "".join(
        f"    ip daddr {host} tcp dport {port} meta skuid != 0 counter reject with tcp reset\n"
        for host, port in addresses
    )
    return (
        f"add table inet {TABLE}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        "  chain output {\n"
        "    type filter hook output priority 0; policy accept;\n"
        f"{refuse}"
        "  }\n"
        "}\n"
    )


def guard_forward(*addresses: str) -> str | None:
    """Only root may connect to each of `addresses` (HOST:PORT, IPv4) from now on; the problem,
    if it could not be done."""
    pairs = [(host, int(port)) for host, _, port in (a.rpartition(":") for a in addresses)]
    if os.geteuid() != 0:
        return "the agent does not run as root: the link's forward is not guarded"
    nft = shutil.which("nft")
    if nft is None:
        return "nft (nftables) is not installed: the link's forward is not guarded"
    try:
        res = subprocess.run(
            [nft, "-f", "-"],
            input=rules(pairs),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nft could not run: {exc}"
    if res.returncode != 0:
        return f"nft refused the rule: {res.stderr.strip()[-300:]}"
    log.info("the link's way out (%s) is open to root only", ", ".join(addresses))
    return None
