"""A restored guest reseeds its kernel's random generator from the bytes its new seed carries
(agent/entropy.py), before it makes anything from it."""

from __future__ import annotations

import base64
import errno
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from agentic_sandbox.agent import entropy, identity
from agentic_sandbox.fleet import EgressPolicy, Fleet
from agentic_sandbox.provision import load_catalog
from agentic_sandbox.provision.pipeline import Provisioner, ProvisionRequest
from tests.unit.agent.test_agent_identity import runtime, seed

REPO = Path(__file__).resolve().parents[3]


def test_the_bytes_go_to_the_kernel_credited_then_it_reseeds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[int, Any]] = []
    monkeypatch.setattr(entropy.fcntl, "ioctl", lambda fd, op, arg=0: calls.append((op, arg)))
    device = tmp_path / "urandom"
    device.write_bytes(b"")
    data = bytes(range(33))  # not a multiple of the kernel's 4-byte words
    entropy.reseed_kernel_rng(data, str(device))
    assert [op for op, _ in calls] == [entropy.RNDADDENTROPY, entropy.RNDRESEEDCRNG]
    info = calls[0][1]
    bits, size = struct.unpack_from("ii", info)
    assert (bits, size) == (33 * 8, 33)
    assert info[8 : 8 + 33] == data and len(info) % 4 == 0


@pytest.mark.parametrize("size", [0, 15, 513])
def test_too_few_or_too_many_bytes_are_refused(size: int) -> None:
    with pytest.raises(ValueError, match="entropy"):
        entropy.reseed_kernel_rng(bytes(size))


def test_the_real_kernel_takes_them_from_root_and_refuses_anyone_else() -> None:
    """This machine's kernel (the test runs as root, as the guest's agent does): root's
    bytes are taken and the generator reseeds; another user is refused with EPERM, named."""
    code = (
        "import os\n"
        "from agentic_sandbox.agent import entropy\n"
        "try:\n"
        "    entropy.reseed_kernel_rng(os.urandom(32))\n"
        "except entropy.ReseedFailed as exc:\n"
        "    print('refused', exc.errno, exc)\n"
        "else:\n"
        "    print('reseeded')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    as_root = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    want = "reseeded" if os.geteuid() == 0 else f"refused {errno.EPERM}"
    assert as_root.stdout.startswith(want), as_root
    if os.geteuid() != 0:
        return  # only root can become another user
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, with this process's module already loaded
        try:
            os.setgid(65534)
            os.setuid(65534)
            entropy.reseed_kernel_rng(os.urandom(32))
            os.write(write, b"reseeded")
        except entropy.ReseedFailed as exc:
            os.write(write, f"refused {exc.errno} {exc}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    assert said.startswith(f"refused {errno.EPERM}"), said
    assert "adding entropy to /dev/urandom" in said


def test_every_seed_carries_its_own_entropy(tmp_path: Path) -> None:
    import json

    prov = Provisioner(cast(Fleet, object()), tmp_path)
    req = ProvisionRequest(
        instance_id="vm-1",
        owner="op",
        loadout=load_catalog().resolve("minimal"),
        network=EgressPolicy.ISOLATED,
    )
    made = [json.loads(prov.seed_files(req, None).front) for _ in range(2)]
    got = [identity.SeedIdentity.from_json(m).entropy for m in made]
    assert len(got[0]) == 32 and len(got[1]) == 32 and got[0] != got[1]


def test_a_seed_without_usable_entropy_reads_as_none() -> None:
    base = {"instance_id": "a-1"}
    assert identity.SeedIdentity.from_json(base).entropy == b""
    assert identity.SeedIdentity.from_json({**base, "entropy": "not base64!"}).entropy == b""
    assert identity.SeedIdentity.from_json({**base, "entropy": 7}).entropy == b""
    good = base64.b64encode(b"x" * 32).decode()
    assert identity.SeedIdentity.from_json({**base, "entropy": good}).entropy == b"x" * 32


async def test_the_switch_reseeds_before_the_key_and_the_machine_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentic_sandbox.agent import runtime as runtime_module

    rt = runtime(tmp_path)
    order: list[str] = []
    new = seed("web-8")
    new = identity.SeedIdentity(**{**new.__dict__, "entropy": b"e" * 32})
    monkeypatch.setattr(identity, "read_seed", lambda: new)
    monkeypatch.setattr(
        identity, "read_seed_head", lambda known=None: identity.SeedHead(b"fp", None)
    )
    monkeypatch.setattr(identity, "unlock_cdrom_trays", lambda: None)
    monkeypatch.setattr(entropy, "reseed_kernel_rng", lambda data: order.append(f"reseed {data!r}"))

    def keys(instance_id: str) -> Any:
        order.append(f"key {instance_id}")
        return cast(Any, None)

    monkeypatch.setattr(runtime_module, "make_keys", keys)
    monkeypatch.setattr(
        identity, "refresh_guest_identity", lambda s, **kw: order.append("machine-id")
    )
    assert await rt.adopt_seed_identity() is True
    assert order == [f"reseed {b'e' * 32!r}", "key web-8", "machine-id"]
