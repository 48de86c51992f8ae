"""Egress policy enforced by QEMU on the host: `isolated` reaches only the agent link."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from agentic_sandbox.fleet import EgressPolicy
from tests.support.fleet_real_env import RealEnv, wait_log

pytestmark = pytest.mark.libvirt_real


class Listener:
    """A loopback TCP server that answers any line with "pong" and records what it got."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            try:
                data = conn.recv(4096)
                if data:
                    self.received.append(data)
                    conn.sendall(b"pong\n")
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@contextmanager
def listeners(n: int) -> Iterator[list[Listener]]:
    ls = [Listener() for _ in range(n)]
    try:
        yield ls
    finally:
        for listener in ls:
            listener.close()


async def test_isolated_reaches_only_the_agent_link_nat_reaches_host(real: RealEnv) -> None:
    f = real.fleet
    with listeners(3) as (agent, other_iso, other_nat):
        await asyncio.gather(
            f.create(
                real.spec(
                    "net-iso",
                    egress=EgressPolicy.ISOLATED,
                    agent_port=agent.port,
                    cmdline=f"sbx.probe={agent.port},10.0.2.254:{other_iso.port}",
                )
            ),
            f.create(
                real.spec(
                    "net-nat",
                    egress=EgressPolicy.NAT,
                    agent_port=agent.port,
                    cmdline=f"sbx.probe={agent.port},10.0.2.254:{other_nat.port}",
                )
            ),
        )
        _, iso = await wait_log(f, "net-iso", rb"SBX-TICK 0\b", timeout=60)
        _, nat = await wait_log(f, "net-nat", rb"SBX-TICK 0\b", timeout=60)
        # isolated: the agent's forward (10.0.2.2:<agent port>) works, the host alias
        # (10.0.2.254 in both policies) does not
        assert f"SBX-PROBE {agent.port} ok".encode() in iso, iso
        assert f"SBX-PROBE {other_iso.port} fail".encode() in iso, iso
        assert other_iso.received == []
        # nat: the same forward, and ordinary user-mode NAT reaches host loopback services
        # through the alias
        assert f"SBX-PROBE {agent.port} ok".encode() in nat, nat
        assert f"SBX-PROBE {other_nat.port} ok".encode() in nat, nat
        assert any(b"hello-from-guest" in r for r in other_nat.received)
        assert sum(b"hello-from-guest" in r for r in agent.received) == 2
