"""The agent takes on the identity its seed names (clones and warm-pool hand-offs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentic_sandbox.agent import identity
from agentic_sandbox.agent.config import load, parser
from agentic_sandbox.agent.runtime import AgentRuntime


def make_config(tmp_path: Path) -> Path:
    (tmp_path / "state").mkdir()
    (tmp_path / "ca.pem").write_text("old-ca")
    (tmp_path / "token").write_text("sbe_old")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        'instance_id = "golden-1"\nserver = "10.0.2.2:8120"\n'
        f'ca_cert = "{tmp_path / "ca.pem"}"\n'
        f'enrollment_token_file = "{tmp_path / "token"}"\n'
        f'state_dir = "{tmp_path / "state"}"\nseed_identity = true\n'
    )
    return cfg


def runtime(tmp_path: Path) -> AgentRuntime:
    args: argparse.Namespace = parser().parse_args(["--config", str(make_config(tmp_path))])
    return AgentRuntime(load(args))


def seed(instance_id: str) -> identity.SeedIdentity:
    return identity.SeedIdentity(
        instance_id=instance_id,
        hostname=instance_id,
        server="10.0.2.2:9120",
        enroll_server="10.0.2.2:9121",
        server_name="agentic-sandbox-server",
        gateway="10.0.2.2:9124",
        ca_pem="new-ca",
        enrollment_token="sbe_new",
        issued_at=0.0,
    )


async def test_a_new_seed_replaces_the_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime(tmp_path)
    assert rt.cfg.seed_identity and rt.cfg.instance_id == "golden-1"
    for p in (rt.cfg.key_path, rt.cfg.cert_path, rt.cfg.cert_meta_path):
        p.write_text("old")
    refreshed: list[str] = []
    monkeypatch.setattr(identity, "read_seed", lambda: seed("web-7"))
    monkeypatch.setattr(
        identity, "read_seed_head", lambda known=None: identity.SeedHead(b"fp", None)
    )
    monkeypatch.setattr(identity, "unlock_cdrom_trays", lambda: None)  # not this host's
    monkeypatch.setattr(
        identity, "refresh_guest_identity", lambda s, **kw: refreshed.append(s.hostname)
    )
    # never touch this machine's own SSH host keys
    monkeypatch.setattr(identity, "refresh_ssh_host_keys", lambda: refreshed.append("ssh"))

    assert await rt.adopt_seed_identity() is True
    assert refreshed == ["web-7"]  # SSH host keys wait for the link (or a backoff)
    rt._refresh_ssh_keys_if_due()
    await asyncio.gather(*rt._background)
    assert refreshed == ["web-7", "ssh"]
    assert rt.cfg.instance_id == "web-7" and rt.cfg.server == "10.0.2.2:9120"
    assert rt.cfg.enroll_server == "10.0.2.2:9121" and rt.cfg.gateway == "10.0.2.2:9124"
    assert (tmp_path / "token").read_text() == "sbe_new"
    assert (tmp_path / "ca.pem").read_text() == "new-ca"
    assert not rt.cfg.cert_path.exists() and not rt.cfg.key_path.exists()  # old instance's cert
    saved = tomllib.loads((tmp_path / "agent.toml").read_text())
    assert saved["instance_id"] == "web-7" and saved["seed_identity"] is True
    assert "enrollment_token" not in saved  # the token stays in its 0600 file

    # the same seed again changes nothing
    assert await rt.adopt_seed_identity() is False
    assert refreshed == ["web-7", "ssh"]


async def test_host_agents_ignore_seeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(tmp_path)
    rt.cfg.seed_identity = False
    monkeypatch.setattr(identity, "read_seed", lambda: seed("other"))
    assert await rt.adopt_seed_identity() is False
    assert rt.cfg.instance_id == "golden-1"


@dataclass
class FakeClock:
    """A realtime clock the test owns: what it reads, whether it may be set, what it was set to."""

    at: float
    root: bool = True
    refuse: bool = False
    set_to: list[float] = field(default_factory=list)

    def now(self) -> float:
        return self.at

    def may_set(self) -> bool:
        return self.root

    def set(self, unix_time: float) -> None:
        if self.refuse:
            raise PermissionError(1, "Operation not permitted")
        self.set_to.append(unix_time)
        self.at = unix_time


def test_clock_is_only_stepped_beyond_the_tolerance() -> None:
    clock = FakeClock(at=1_000.0)
    assert identity.step_clock(1_001.5, clock=clock) is False  # within 2 s: left alone
    assert identity.step_clock(998.5, clock=clock) is False  # behind, within 2 s
    assert clock.set_to == []
    assert identity.step_clock(1_300.0, clock=clock) is True  # a restored guest, 5 min behind
    assert clock.set_to == [1_300.0] and clock.now() == 1_300.0
    assert identity.step_clock(1_300.0, clock=clock) is False  # now in step: nothing more
    assert identity.step_clock(1_000.5, tolerance=0.0, clock=clock) is True  # a seed: exact
    assert clock.set_to == [1_300.0, 1_000.5]


def test_clock_is_never_stepped_without_root_and_a_refusal_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    not_root = FakeClock(at=1_000.0, root=False)
    assert identity.step_clock(5_000.0, clock=not_root) is False and not_root.set_to == []
    refused = FakeClock(at=1_000.0, refuse=True)
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        assert identity.step_clock(5_000.0, clock=refused) is False
    assert refused.now() == 1_000.0
    assert "cannot set the clock" in caplog.text


def test_seed_identity_parses_the_provisioners_file() -> None:
    s = identity.SeedIdentity.from_json(
        {"instance_id": "a-1", "server": "10.0.2.2:1", "enrollment_token": "t", "ca_pem": "c"}
    )
    assert s.hostname == "a-1" and s.enroll_server == "" and s.issued_at == 0.0


async def test_a_seed_change_is_read_once_by_the_watcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seed without the system-area record (an older server's): the watcher notices the new
    seed and the identity switch uses what it read: inside an emulated guest every extra mount
    costs a hand-off time. An unchanged seed is never mounted again (the agent checks it before
    every reconnect)."""
    from agentic_sandbox.agent import seedwatch

    rt = runtime(tmp_path)
    reads: list[str] = []
    fingerprint = [b"old"]

    def read() -> identity.SeedIdentity:
        reads.append("read")
        return seed("golden-1" if fingerprint[0] == b"old" else "web-9")

    monkeypatch.setattr(seedwatch, "SEED_POLL_SECONDS", 0.01)
    monkeypatch.setattr(identity, "read_seed", read)
    monkeypatch.setattr(
        identity, "read_seed_head", lambda known=None: identity.SeedHead(fingerprint[0], None)
    )
    monkeypatch.setattr(identity, "unlock_cdrom_trays", lambda: None)
    monkeypatch.setattr(identity, "refresh_guest_identity", lambda s, **kw: None)
    assert await rt.adopt_seed_identity() is False  # our own seed
    assert await rt.adopt_seed_identity() is False  # unchanged: fingerprint only
    notified = asyncio.Event()
    watcher = asyncio.create_task(
        rt.seeds.watch(lambda s: s.instance_id == rt.cfg.instance_id, notified.set)
    )
    try:
        for _ in range(5):
            await asyncio.sleep(0.02)
        assert reads == ["read"] and not rt.seeds.changed.is_set()
        fingerprint[0] = b"new"
        await asyncio.wait_for(notified.wait(), 5)
        assert rt.seeds.changed.is_set()
        assert await rt.adopt_seed_identity() is True
        assert rt.cfg.instance_id == "web-9"
        assert reads == ["read", "read"]  # the switch did not mount the seed again
    finally:
        watcher.cancel()


def _seed_json(instance_id: str) -> dict[str, object]:
    return {
        "instance_id": instance_id,
        "server": "10.0.2.2:9120",
        "gateway": "10.0.2.2:9124",
        "enrollment_token": "sbe_new",
        "ca_pem": "new-ca",
        "issued_at": 5.0,
    }


def test_the_provisioners_seed_carries_its_identity_in_the_system_area(tmp_path: Path) -> None:
    """The ISO the provisioner writes (pycdlib) holds the identity record in its first 32 KiB,
    the agent's one 64 KiB read finds it, and the ISO is still the same seed to any ISO 9660
    reader (cloud-init's files by their names, the volume id)."""
    import json

    from agentic_sandbox.provision import SeedFiles, read_seed_iso, write_seed_iso

    payload = json.dumps(_seed_json("web-3")).encode()
    iso = write_seed_iso(
        tmp_path / "seed.iso",
        SeedFiles(user_data="#cloud-config\n", meta_data="instance-id: web-3\n", front=payload),
    )
    head = identity.parse_head(iso.read_bytes()[: identity.HEAD_BYTES])
    assert head.identity is not None and head.identity.instance_id == "web-3"
    assert head.identity.enrollment_token == "sbe_new" and head.identity.issued_at == 5.0
    files = read_seed_iso(iso)
    assert files["user-data"] == b"#cloud-config\n" and files[".volume_id"] == b"cidata"
    # another seed, another fingerprint; the same bytes, the same fingerprint
    other = write_seed_iso(
        tmp_path / "other.iso",
        SeedFiles(
            user_data="#cloud-config\n",
            meta_data="instance-id: web-3\n",
            front=json.dumps(_seed_json("web-4")).encode(),
        ),
    )
    again = identity.parse_head(iso.read_bytes()[: identity.HEAD_BYTES])
    assert again.fingerprint == head.fingerprint
    assert identity.parse_head(other.read_bytes()[: identity.HEAD_BYTES]).fingerprint != (
        head.fingerprint
    )


def test_a_damaged_or_missing_record_is_no_identity() -> None:
    import json

    from agentic_sandbox.proto import seed_record

    good = seed_record.pack(json.dumps(_seed_json("web-5")).encode())
    assert identity.parse_head(good + bytes(100)).identity is not None
    flipped = bytearray(good)
    flipped[-3] ^= 1
    assert identity.parse_head(bytes(flipped)).identity is None  # digest mismatch
    assert identity.parse_head(good[:-10]).identity is None  # cut short
    assert identity.parse_head(bytes(65536)).identity is None  # an older seed: zeros
    not_json = seed_record.pack(b"[1, 2]")
    assert identity.parse_head(not_json).identity is None
    with pytest.raises(seed_record.RecordTooLarge):
        seed_record.pack(bytes(seed_record.MAX_PAYLOAD + 1))


async def test_a_seed_with_its_record_is_never_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-off's read: the watcher takes the new identity from the seed's head, and
    neither it nor the switch mounts the seed."""
    import json

    from agentic_sandbox.agent import seedwatch
    from agentic_sandbox.proto import seed_record

    rt = runtime(tmp_path)
    heads = [identity.parse_head(seed_record.pack(json.dumps(_seed_json("golden-1")).encode()))]

    def mount() -> identity.SeedIdentity:
        raise AssertionError("the seed was mounted")

    monkeypatch.setattr(seedwatch, "SEED_POLL_SECONDS", 0.01)
    monkeypatch.setattr(identity, "read_seed", mount)
    monkeypatch.setattr(identity, "read_seed_head", lambda known=None: heads[0])
    monkeypatch.setattr(identity, "unlock_cdrom_trays", lambda: None)
    monkeypatch.setattr(identity, "refresh_guest_identity", lambda s, **kw: None)
    assert await rt.adopt_seed_identity() is False  # our own seed
    notified = asyncio.Event()
    watcher = asyncio.create_task(
        rt.seeds.watch(lambda s: s.instance_id == rt.cfg.instance_id, notified.set)
    )
    try:
        heads[0] = identity.parse_head(seed_record.pack(json.dumps(_seed_json("web-6")).encode()))
        await asyncio.wait_for(notified.wait(), 5)
        assert await rt.adopt_seed_identity() is True
        assert rt.cfg.instance_id == "web-6"
        assert (tmp_path / "token").read_text() == "sbe_new"
    finally:
        watcher.cancel()


def test_the_seed_already_read_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher reads the head four times a second: only a new fingerprint parses the
    record (an emulated guest's idle CPU)."""
    import json

    from agentic_sandbox.proto import seed_record

    head = seed_record.pack(json.dumps(_seed_json("web-7")).encode()) + bytes(100)
    first = identity.parse_head(head)
    assert first.identity is not None and first.identity.instance_id == "web-7"
    unpacked: list[bytes] = []
    real = seed_record.unpack
    monkeypatch.setattr(seed_record, "unpack", lambda b: unpacked.append(b) or real(b))
    again = identity.parse_head(head, known=first.fingerprint)
    assert again.fingerprint == first.fingerprint and again.identity is None
    assert unpacked == []
    assert identity.parse_head(head, known=b"another seed").identity is not None
    assert len(unpacked) == 1
