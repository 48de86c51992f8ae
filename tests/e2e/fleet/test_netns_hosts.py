"""Hypervisors across a network: hosts in network namespaces the test makes, each with its own
libvirtd reached over ``qemu+tcp://``; a guest there reaches the control plane at that host's
`control_address` (the host side of its veth); the host cut off and brought back.

The guest is the tiny one (`tests/support/tiny_guest.py`): its ``sbx.probe`` connects through
the guest forward (10.0.2.2:<agent port>) the way an agent would, so no Debian boot is needed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import libvirt
import pytest

from agentic_sandbox.fleet import (
    InstanceState,
    NoCapacity,
)
from tests.support.control_listener import ControlListener
from tests.support.fleet_real_env import RealEnv, wait_log
from tests.support.netns_fleet import namespace_fleet, tiny_guest_or_fail, tiny_images
from tests.support.netns_libvirt import NamespaceHypervisor
from tests.support.polling import until

pytestmark = pytest.mark.libvirt_real


def _netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_namespace_hypervisors_answer_over_tcp_on_their_address_only() -> None:
    if os.geteuid() != 0:
        pytest.fail("namespace hypervisors need root (ip netns, unshare -m)")
    with NamespaceHypervisor("a") as a, NamespaceHypervisor("b") as b:
        assert a.address != b.address and a.data_dir != b.data_dir
        for h in (a, b):
            conn = libvirt.open(h.uri)
            try:
                assert conn.listAllNetworks(0) == []  # its own daemon: no networks, no bridges
                assert conn.listAllDomains(0) == []
            finally:
                conn.close()
            assert h.listening() == [f"{h.address}:16509"]
            pids = [int((h.root / n).read_text()) for n in ("libvirtd.pid", "virtlogd.pid")]
            names, roots = (a.ns.name, b.ns.name), (a.root, b.root)
    listed = _netns_names()
    assert not any(n in listed for n in names), listed
    assert not any(r.exists() for r in roots)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


@pytest.fixture
async def far() -> AsyncIterator[tuple[RealEnv, NamespaceHypervisor]]:
    """A fleet whose one host is a namespace hypervisor, with the tiny guest's images on it."""
    guest = tiny_guest_or_fail()
    with NamespaceHypervisor("far") as h:
        async with namespace_fleet(h, guest, "far", h.uri) as env:
            # uploaded over the network, read back over a stream and checked: marked
            for name, path in tiny_images(guest):
                with open(path, "rb") as src:
                    want = hashlib.file_digest(src, "sha256").hexdigest()
                got = await env.fleet.hosts["far"].volumes.verified_digest("bases", name)
                assert got == want, name
            yield env, h


async def test_a_guest_on_a_namespace_host_reaches_its_control_address_and_outlives_a_cut(
    far: tuple[RealEnv, NamespaceHypervisor],
) -> None:
    env, h = far
    f = env.fleet
    gateway = ControlListener(h.control_address)
    try:
        inst = await f.create(
            env.spec("far-1", agent_port=gateway.port, cmdline=f"sbx.probe={gateway.port}")
        )
        assert inst.host == "far"
        try:
            _, log = await wait_log(f, "far-1", rb"SBX-TICK 1\b", timeout=120)  # over a stream
        except AssertionError as e:
            on_disk = Path(f.index["far-1"].record.serial_log)
            tail = on_disk.read_bytes()[-600:] if on_disk.exists() else b"(no file)"
            raise AssertionError(f"{e}\non the host's disk: {tail!r}\n{h.log_tail(1500)}") from e
        assert f"SBX-PROBE {gateway.port} ok".encode() in log, (log[-600:], gateway.received)
        # QEMU runs in the namespace: its forward came over the veth, from the host's address
        assert any(peer == h.address and b"hello-from-guest" in d for peer, d in gateway.received)

        # the link goes down: the host's instance is unknown (not deleted), placements skip it
        h.link(up=False)
        await until(
            lambda: f.index["far-1"].state is InstanceState.UNKNOWN,
            timeout=30,
            what="far-1 unknown after the cut",
        )
        assert "host.unreachable" in env.kinds()
        assert not (await f.host_info("far")).reachable
        with pytest.raises(NoCapacity, match="far"):
            await f.create(env.spec("far-2", host="far"))
        assert "far-2" not in f.index

        # the link comes back: reconnected and reconciled; the guest ran on the whole time
        h.link(up=True)
        await until(
            lambda: f.index["far-1"].state is InstanceState.RUNNING,
            timeout=60,
            what="far-1 reconciled after the link came back",
        )
        assert "host.reconnected" in env.kinds()
        assert env.kinds("far-1").count("instance.lost") == 0
        offset = len(await f.read_serial_log("far-1"))
        await wait_log(f, "far-1", rb"SBX-TICK \d+", offset=offset)
    finally:
        gateway.close()
