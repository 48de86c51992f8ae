"""A hypervisor reached over ``qemu+ssh://`` with a key the operator gives. This machine has
no ``sshd``, so the namespace host's SSH endpoint is `tests/support/ssh_standin.py` (asyncssh,
in the host's network namespace): it admits one client key and joins each session to that
host's libvirtd socket whatever command is asked for — an sshd with ``ForceCommand
virt-ssh-helper``. The fleet opens it over libvirt's libssh2 transport with the key file and
a known_hosts file: empty, the first connection records the host's key (trust on first use),
and from then on it is checked; the tiny guest is placed there (images uploaded over SSH) and
reaches its control address. A host showing another key than the pinned one is refused at
once, naming the host: no hang, nothing placed there.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncssh
import pytest

from agentic_sandbox.fleet import (
    FleetEventKind,
    HostSpec,
    NoCapacity,
)
from tests.support.control_listener import ControlListener
from tests.support.fleet_real_env import RealEnv, wait_log
from tests.support.lifetime import die_with_parent
from tests.support.netns_fleet import namespace_fleet, tiny_guest_or_fail
from tests.support.netns_libvirt import NamespaceHypervisor

pytestmark = pytest.mark.libvirt_real
SSH_PORT = 2222


@contextlib.contextmanager
def ssh_endpoint(
    h: NamespaceHypervisor, port: int, host_key: Path, authorized: Path
) -> Iterator[None]:
    proc = subprocess.Popen(
        [
            "nsenter",
            f"--net=/run/netns/{h.ns.name}",
            "--",
            sys.executable,
            "-m",
            "tests.support.ssh_standin",
            h.address,
            str(port),
            str(host_key),
            str(authorized),
            str(h.run_dir / "libvirt-sock"),
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[3],
        preexec_fn=die_with_parent,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready" once it listens (EOF if it died)
        assert line == b"ready\n", line
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def ssh_host(tmp_path: Path) -> AsyncIterator[tuple[RealEnv, NamespaceHypervisor, Path]]:
    guest = tiny_guest_or_fail()
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(keys / "host"))
    client = asyncssh.generate_private_key("ssh-ed25519")
    client.write_private_key(str(keys / "id"))  # what the operator puts in the vault
    os.chmod(keys / "id", 0o600)
    client.write_public_key(str(keys / "authorized"))
    known = keys / "known_hosts"
    known.write_text("")  # nothing known: trust on first use
    with (
        NamespaceHypervisor("ssh") as h,
        ssh_endpoint(h, SSH_PORT, keys / "host", keys / "authorized"),
    ):
        async with namespace_fleet(
            h,
            guest,
            "ssh",
            f"qemu+ssh://root@{h.address}:{SSH_PORT}/system",
            ssh_key_file=str(keys / "id"),
            ssh_known_hosts=str(known),
        ) as env:
            yield env, h, keys


async def test_a_guest_is_placed_on_a_host_reached_over_ssh_with_its_key_pinned(
    ssh_host: tuple[RealEnv, NamespaceHypervisor, Path],
) -> None:
    env, h, keys = ssh_host
    f = env.fleet
    host_pub = asyncssh.read_private_key(str(keys / "host")).export_public_key().decode().split()
    recorded = (keys / "known_hosts").read_text().split()
    # first use recorded the key the host showed, for its address and port; checked from now on
    assert recorded[:3] == [f"[{h.address}]:{SSH_PORT}", host_pub[0], host_pub[1]], recorded
    assert "known_hosts_verify=normal" in f.hosts["ssh"].spec.connection_uri
    gateway = ControlListener(h.control_address)
    try:
        inst = await f.create(
            env.spec("ssh-1", agent_port=gateway.port, cmdline=f"sbx.probe={gateway.port}")
        )
        assert inst.host == "ssh"
        _, log = await wait_log(f, "ssh-1", rb"SBX-TICK 1\b", timeout=120)  # over SSH
        assert f"SBX-PROBE {gateway.port} ok".encode() in log, (log[-600:], gateway.received)
        assert any(peer == h.address and b"hello-from-guest" in d for peer, d in gateway.received)
    finally:
        gateway.close()


async def test_a_host_showing_another_key_than_the_pinned_one_is_refused(
    ssh_host: tuple[RealEnv, NamespaceHypervisor, Path],
    tmp_path: Path,
) -> None:
    env, h, keys = ssh_host
    f = env.fleet
    imposter = tmp_path / "imposter"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(imposter))
    pinned = tmp_path / "known_hosts"  # the real host's key, pinned for the imposter's port
    real = asyncssh.read_private_key(str(keys / "host")).export_public_key().decode()
    pinned.write_text(f"[{h.address}]:{SSH_PORT + 1} {real}")
    with ssh_endpoint(h, SSH_PORT + 1, imposter, keys / "authorized"):
        started = time.monotonic()
        info = await f.add_host(
            HostSpec(
                name="imposter",
                uri=f"qemu+ssh://root@{h.address}:{SSH_PORT + 1}/system",
                ssh_key_file=str(keys / "id"),
                ssh_known_hosts=str(pinned),
                accel="tcg",
                files="remote",
                data_dir=h.data_dir + "-imposter",
            )
        )
        try:
            assert time.monotonic() - started < 20  # refused, not a hang
            assert not info.reachable
            assert "HOST KEY VERIFICATION FAILED" in info.reason, info.reason
            said = [
                e.detail
                for e in env.events
                if e.kind is FleetEventKind.HOST_UNREACHABLE and e.host == "imposter"
            ]
            assert said and "imposter" in said[0] and "host key" in said[0].lower(), said
            with pytest.raises(NoCapacity, match="imposter"):
                await f.create(env.spec("ssh-x", host="imposter"))
            assert "ssh-x" not in f.index
            assert pinned.read_text().split()[2] == real.split()[1]  # the pin is not replaced
        finally:
            await f.remove_host("imposter", force=True)
