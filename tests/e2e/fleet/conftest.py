"""Real tier: qemu:///system under TCG with a tiny guest the tests build themselves.

Fails (never skips) with the reason when libvirtd/QEMU or the guest kernel are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox.fleet import Fleet, FleetConfig, FleetError, FleetEvent, HostSpec
from tests.support import tiny_guest
from tests.support.fleet_real_env import RealEnv, purge_domains
from tests.support.libvirt_daemons import MAIN_URI, DaemonUnavailable, ensure_main_libvirtd

pytestmark = pytest.mark.libvirt_real


@pytest.fixture(scope="session")
def guest() -> tiny_guest.TinyGuest:
    if os.geteuid() != 0:
        pytest.fail("the real fleet tier needs root (qemu:///system, unshare -m)")
    try:
        ensure_main_libvirtd()
    except (DaemonUnavailable, OSError) as e:
        pytest.fail(f"the real fleet tier cannot run: libvirtd unavailable: {e}")
    try:
        return tiny_guest.build()
    except tiny_guest.TinyGuestUnavailable as e:
        pytest.fail(f"the real fleet tier cannot run: {e}")


@pytest.fixture
async def real(guest: tiny_guest.TinyGuest) -> AsyncIterator[RealEnv]:
    root = Path(tempfile.mkdtemp(prefix="sbx-fleet-e2e-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    events: list[FleetEvent] = []
    fleet = Fleet(
        FleetConfig(
            data_dir=str(root / "h1"),
            shutdown_timeout_s=3,
            restart_delay_s=0.2,
            reconnect_initial_s=0.1,
            reconnect_max_s=1.0,
            pool_memory_headroom_mib=256,
            pool_refill_delay_s=0.5,
        ),
        on_event=events.append,
    )
    env = RealEnv(fleet, events, root, guest)
    try:
        await fleet.open([HostSpec(name="h1", uri=MAIN_URI, accel="tcg")])
        for name, path in (
            ("tiny-kernel", guest.kernel),
            ("tiny-initrd", guest.initrd),
            ("tiny-base", guest.base_disk),
        ):
            await fleet.import_image(name, str(path))
        yield env
    finally:
        with contextlib.suppress(Exception):
            await fleet.drain_pools()
        for inst in list(fleet.index):
            with contextlib.suppress(FleetError, Exception):
                await fleet.delete(inst)
        for st in list(fleet.states.saved):
            with contextlib.suppress(FleetError, Exception):
                await fleet.delete_state(st)
        for h in list(fleet.hosts):
            with contextlib.suppress(Exception):
                await fleet.remove_host(h, force=True, forget_storage=True)
        await fleet.close()
        for cleanup in env.extra_cleanup:
            with contextlib.suppress(Exception):
                cleanup()  # type: ignore[operator]
        purge_domains(MAIN_URI, root)
        shutil.rmtree(root, ignore_errors=True)
