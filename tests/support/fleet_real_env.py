"""The real tier's environment: a Fleet on qemu:///system (TCG) with the tiny guest imported."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import libvirt

from agentic_sandbox.fleet import (
    EgressPolicy,
    Fleet,
    FleetEvent,
    InstanceSpec,
    KernelBoot,
    Resources,
)
from tests.support.tiny_guest import TinyGuest

TICK_RE = re.compile(rb"SBX-TICK (\d+)")


@dataclass
class RealEnv:
    fleet: Fleet
    events: list[FleetEvent]
    root: Path
    guest: TinyGuest
    extra_cleanup: list[object] = field(default_factory=list)

    def spec(
        self,
        iid: str,
        *,
        egress: EgressPolicy = EgressPolicy.ISOLATED,
        agent_port: int = 8120,
        cmdline: str = "",
        host: str | None = None,
        memory_mib: int = 160,
    ) -> InstanceSpec:
        return InstanceSpec(
            instance_id=iid,
            image="tiny-base",
            egress=egress,
            agent_port=agent_port,
            host=host,
            boot=KernelBoot(
                kernel="tiny-kernel",
                initrd="tiny-initrd",
                cmdline=f"{self.guest.cmdline} {cmdline}".strip(),
            ),
            resources=Resources(memory_mib=memory_mib, tb_cache_mib=32),
        )

    def kinds(self, instance_id: str | None = None) -> list[str]:
        return [
            e.kind.value for e in self.events if instance_id is None or e.instance_id == instance_id
        ]


async def wait_log(
    fleet: Fleet, iid: str, pattern: bytes, *, offset: int = 0, timeout: float = 40.0
) -> tuple[float, bytes]:
    """Seconds until ``pattern`` (regex) shows in the serial log after ``offset``, and the log."""
    start = time.monotonic()
    rx = re.compile(pattern)
    data = b""
    while time.monotonic() - start < timeout:
        data = await fleet.read_serial_log(iid, offset)
        if rx.search(data):
            return time.monotonic() - start, data
        await asyncio.sleep(0.05)
    raise AssertionError(f"{iid}: {pattern!r} not in serial log after {timeout}s: {data[-400:]!r}")


def ticks(data: bytes) -> list[int]:
    return [int(m) for m in TICK_RE.findall(data)]


def domains_under(uri: str, root: Path) -> list[str]:
    """Domains of ``uri`` whose XML mentions ``root`` (made by this test)."""
    out = []
    with contextlib.suppress(libvirt.libvirtError):
        conn = libvirt.open(uri)
        for d in conn.listAllDomains(0):
            with contextlib.suppress(libvirt.libvirtError):
                if str(root) in d.XMLDesc(0):
                    out.append(d.name())
        conn.close()
    return out


def purge_domains(uri: str, root: Path) -> None:
    with contextlib.suppress(libvirt.libvirtError):
        conn = libvirt.open(uri)
        for d in conn.listAllDomains(0):
            with contextlib.suppress(libvirt.libvirtError):
                if str(root) not in d.XMLDesc(0):
                    continue
                if d.isActive():
                    d.destroy()
                d.undefineFlags(
                    libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                    | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                )
        for p in conn.listAllStoragePools(0):
            with contextlib.suppress(libvirt.libvirtError):
                if str(root) in p.XMLDesc(0):
                    if p.isActive():
                        p.destroy()
                    p.undefine()
        conn.close()


def port_listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
