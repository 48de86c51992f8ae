from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox.fleet import Fleet, FleetConfig, FleetEvent, HostSpec
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import Faults, node_uri


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="sbx-fleet-it-", dir="/var/tmp"))
    events: list[FleetEvent] = []
    faults = Faults()
    fleet = Fleet(
        FleetConfig(
            data_dir=str(root / "fleet"),
            restart_delay_s=0.05,
            shutdown_timeout_s=1,
            pool_memory_headroom_mib=0,
            pool_warmup_s=0.01,
            pool_refill_delay_s=0,
        ),
        on_event=events.append,
        fault_hook=faults,
    )
    await fleet.open([HostSpec(name="h1", uri=node_uri(root, "h1"))])
    img = root / "img.qcow2"
    img.write_bytes(b"\0" * 4096)
    await fleet.import_image("img", str(img))
    try:
        yield Env(fleet, events, root, faults)
    finally:
        await fleet.close()
        shutil.rmtree(root, ignore_errors=True)
