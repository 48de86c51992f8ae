"""`sandboxctl instance port-forward ID [LOCAL:]REMOTE` (like `kubectl port-forward`).

Listens on 127.0.0.1:LOCAL (only; LOCAL 0 or left out with the colon: any free port, and
`REMOTE` alone: the same number as the remote port), prints the local address, and tunnels
every accepted connection to 127.0.0.1:REMOTE inside the instance over its agent link (one
tunnel each, through the SDK). Before listening, one tunnel is opened and closed to check the
port answers, so `connection-refused` is said at once rather than on the first connection.
Runs until interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentic_sandbox.sandboxctl.exits import EXIT_USAGE, CliError
from agentic_sandbox.sdk import AsyncClient


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("id")
    v.add_argument("ports", metavar="[LOCAL:]REMOTE", help="e.g. 8000, 9000:8000, :8000")
    v.add_argument(
        "--no-check", action="store_true", help="do not try the remote port before listening"
    )


def parse_ports(text: str) -> tuple[int, int]:
    """`[LOCAL:]REMOTE` → (local, remote); REMOTE alone means the same local port."""
    local_s, sep, remote_s = text.rpartition(":")
    try:
        remote = int(remote_s)
        local = (int(local_s) if local_s else 0) if sep else remote
    except ValueError:
        raise CliError(f"ports: {text!r} is not [LOCAL:]REMOTE (numbers)", EXIT_USAGE) from None
    if not 1 <= remote <= 65535 or not 0 <= local <= 65535:
        raise CliError(f"ports: {text!r}: a port is 1-65535 (LOCAL may be 0)", EXIT_USAGE)
    return local, remote


async def instance_port_forward(c: AsyncClient, a: argparse.Namespace) -> int:
    local, remote = parse_ports(a.ports)
    if not a.no_check:
        probe = await c.instances.tunnel(a.id, remote)  # refusals raise ApiError, by name
        await probe.close()
    try:
        fwd = await c.instances.port_forward(a.id, remote, local_port=local)
    except OSError as exc:
        raise CliError(f"cannot listen on 127.0.0.1:{local}: {exc.strerror}", EXIT_USAGE) from None
    async with fwd:
        host, port = fwd.address
        print(f"Forwarding from {host}:{port} -> {a.id}:{remote}", flush=True)
        try:
            await fwd.serve_forever()
        except asyncio.CancelledError:
            print("sandboxctl: port-forward stopped", file=sys.stderr)
            raise
    return 0
