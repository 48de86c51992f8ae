"""A fleet whose one host is a namespace hypervisor (`netns_libvirt.NamespaceHypervisor`), with
the tiny guest's images on it: what the namespace-host fleet tests (tcp, tls, ssh) share."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox.fleet import Fleet, FleetConfig, FleetError, FleetEvent, HostSpec
from tests.support import tiny_guest
from tests.support.fleet_real_env import RealEnv
from tests.support.netns_libvirt import NamespaceHypervisor


def tiny_images(guest: tiny_guest.TinyGuest) -> list[tuple[str, Path]]:
    """The tiny guest's files by their name in a host's image store."""
    return [
        ("tiny-kernel", guest.kernel),
        ("tiny-initrd", guest.initrd),
        ("tiny-base", guest.base_disk),
    ]


def tiny_guest_or_fail() -> tiny_guest.TinyGuest:
    """The tiny guest, built once; the tier fails (never skips) when it cannot run here."""
    if os.geteuid() != 0:
        pytest.fail("namespace hypervisors need root (ip netns, unshare -m)")
    try:
        return tiny_guest.build()
    except tiny_guest.TinyGuestUnavailable as e:
        pytest.fail(f"the real fleet tier cannot run: {e}")


@contextlib.asynccontextmanager
async def namespace_fleet(
    h: NamespaceHypervisor, guest: tiny_guest.TinyGuest, name: str, uri: str, **spec: Any
) -> AsyncIterator[RealEnv]:
    """A fleet on ``h`` as host ``name`` over ``uri`` (`spec`: the transport's further
    `HostSpec` fields), reachable, with the tiny guest's images imported; afterwards the link
    is up again, every instance deleted and the fleet closed."""
    events: list[FleetEvent] = []
    fleet = Fleet(
        FleetConfig(
            data_dir=str(h.root / "control"),
            shutdown_timeout_s=3,
            reconnect_initial_s=0.1,
            reconnect_max_s=1.0,
            keepalive_interval_s=1,
            keepalive_count=3,
        ),
        on_event=events.append,
    )
    env = RealEnv(fleet, events, h.root, guest)
    try:
        await fleet.open(
            [
                HostSpec(
                    name=name,
                    uri=uri,
                    accel="tcg",
                    files="remote",
                    data_dir=h.data_dir,
                    control_address=h.control_address,
                    **spec,
                )
            ]
        )
        info = await fleet.host_info(name)
        assert info.reachable, (info.reason, h.log_tail(1500))
        for image, path in tiny_images(guest):
            await fleet.import_image(image, str(path), host=name)
        yield env
    finally:
        with contextlib.suppress(Exception):
            h.link(up=True)
        for inst in list(fleet.index):
            with contextlib.suppress(FleetError, Exception):
                await fleet.delete(inst)
        await fleet.close()
