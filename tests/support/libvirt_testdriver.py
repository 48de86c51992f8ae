"""Hosts on libvirt's test driver: each node file is its own private hypervisor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentic_sandbox.broker.instances.pools import DONE_MARKER

if TYPE_CHECKING:
    from agentic_sandbox.broker.instances import FleetComponent

NODE_XML = """<node>
  <cpu><nodes>1</nodes><sockets>1</sockets><cores>{cpus}</cores><threads>1</threads>
    <active>{cpus}</active><mhz>2000</mhz><model>x86_64</model></cpu>
  <memory>{kib}</memory>
</node>
"""


def node_uri(directory: Path, name: str, *, cpus: int = 4, memory_mib: int = 8192) -> str:
    path = directory / f"{name}.xml"
    path.write_text(NODE_XML.format(cpus=cpus, kib=memory_mib * 1024))
    return f"test://{path}"


class Faults:
    """A fault hook: raises at the named stages."""

    def __init__(self) -> None:
        self.fail_at: set[str] = set()
        self.seen: list[str] = []

    def __call__(self, stage: str) -> None:
        self.seen.append(stage)
        if stage in self.fail_at:
            raise RuntimeError(f"injected failure at {stage}")


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.01)


def golden_console_says_done(comp: FleetComponent) -> None:
    """A warm pool's golden VM waits for cloud-init's marker on its serial console; a VM of
    the test driver has no console, so this one says it (the second fake here)."""
    fleet = comp.fleet
    read = fleet.read_serial_log

    async def read_serial_log(instance_id: str, offset: int = 0) -> bytes:
        data = await read(instance_id, offset)
        return data + DONE_MARKER if instance_id.startswith("golden-") else data

    fleet.read_serial_log = read_serial_log  # type: ignore[method-assign]
