"""A warm-pool member stands by: its own seed, its own entropy, the key made ahead and used once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agentic_sandbox.agent import entropy, identity
from agentic_sandbox.agent import runtime as runtime_module
from agentic_sandbox.proto.seed_record import NO_SPARE_KEY, SPARE_KEY_READY
from tests.unit.agent.test_agent_identity import runtime

KeyFuture = asyncio.Future[tuple[bytes, bytes]]


def seed(
    instance_id: str,
    *,
    standby: bool = False,
    entropy_: bytes = b"e" * 32,
    standby_of: str = "",
) -> identity.SeedIdentity:
    return identity.SeedIdentity(
        instance_id=instance_id,
        hostname=instance_id,
        server="10.0.2.2:9120" if not standby else "",
        enroll_server="",
        server_name="",
        gateway="",
        ca_pem="" if standby else "new-ca",
        enrollment_token="" if standby else "sbe_new",
        issued_at=0.0,
        entropy=entropy_,
        standby=standby,
        standby_of=standby_of,
    )


class Guest:
    """The seed drive and the key maker, as the runtime sees them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seed = seed("golden-1")
        self.events: list[str] = []
        self.keys: dict[str, KeyFuture] = {}
        monkeypatch.setattr(identity, "read_seed", lambda: self.seed)
        monkeypatch.setattr(
            identity,
            "read_seed_head",
            lambda known=None: identity.SeedHead(self.seed.instance_id.encode(), None),
        )
        monkeypatch.setattr(identity, "unlock_cdrom_trays", lambda: None)
        monkeypatch.setattr(identity, "refresh_guest_identity", lambda s, **kw: None)
        monkeypatch.setattr(
            entropy, "reseed_kernel_rng", lambda data: self.events.append(f"reseed {data[:1]!r}")
        )
        monkeypatch.setattr(runtime_module, "make_keys", self.make_keys)
        monkeypatch.setattr(runtime_module, "connect_channel", self.connect_channel)
        self.warm = asyncio.Event()  # the warm-up connection's handshake is done when set

    async def connect_channel(
        self, cfg: object, creds: object, service: str, control: object
    ) -> object:
        guest = self

        class Channel:
            async def channel_ready(self) -> None:
                guest.events.append(f"warm-up {service}")
                await guest.warm.wait()

            async def close(self) -> None:
                guest.events.append("warm-up closed")

        return Channel()

    def make_keys(self, instance_id: str) -> KeyFuture:
        self.events.append(f"key {instance_id}")
        fut: KeyFuture = asyncio.get_running_loop().create_future()
        self.keys[instance_id] = fut
        return fut


async def test_a_member_makes_the_key_ahead_and_the_hand_off_uses_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rt = runtime(tmp_path)
    guest = Guest(monkeypatch)
    assert await rt.adopt_seed_identity() is False  # the golden's own seed

    guest.seed = seed("pool-1a2b", standby=True, entropy_=b"m" * 32)
    with caplog.at_level(logging.INFO, logger="agent"):
        assert await rt.adopt_seed_identity() is True
        # reseeded from the member's own entropy first: the restore left every member the same
        assert guest.events == ["reseed b'm'", "key pool-1a2b"]
        assert rt.cfg.instance_id == "pool-1a2b"
        guest.keys["pool-1a2b"].set_result((b"KEY", b"CSR"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert guest.events[-1] == "warm-up enroll"  # the way the hand-off takes, made once
        assert SPARE_KEY_READY not in caplog.text
        guest.warm.set()
        async with asyncio.timeout(5):
            while SPARE_KEY_READY not in caplog.text:  # the console line the fleet pauses on
                await asyncio.sleep(0.01)
        assert guest.events[-1] == "warm-up closed"

    assert rt.seeds.standing_by  # looking for the hand-off's seed more often
    guest.seed = seed("web-1", standby_of="pool-1a2b")  # the hand-off made for this member
    assert await rt.adopt_seed_identity() is True
    assert not rt.seeds.standing_by
    assert guest.events[-2:] == ["warm-up closed", "reseed b'e'"]  # no new key
    assert rt._keys is guest.keys["pool-1a2b"] and rt.cfg.instance_id == "web-1"

    guest.seed = seed("web-2")  # this instance's memory restored as a clone: never that key
    assert await rt.adopt_seed_identity() is True
    assert guest.events[-2:] == ["reseed b'e'", "key web-2"]
    assert rt._keys is guest.keys["web-2"]


@pytest.mark.parametrize("standby_of", ["", "pool-other"])
async def test_a_seed_that_is_not_this_members_hand_off_never_uses_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, standby_of: str
) -> None:
    """The member's memory saved while it stood by (or before it read its hand-off's seed)
    and restored as clones: each clone's seed names no member, or another one, so each makes
    a key of its own and the one made ahead is dropped."""
    rt = runtime(tmp_path)
    guest = Guest(monkeypatch)
    guest.seed = seed("pool-1a2b", standby=True, entropy_=b"m" * 32)
    assert await rt.adopt_seed_identity() is True
    spare = guest.keys["pool-1a2b"]
    spare.set_result((b"KEY", b"CSR"))

    guest.seed = seed("clone-1", standby_of=standby_of)
    assert await rt.adopt_seed_identity() is True
    assert "key clone-1" in guest.events
    assert rt._keys is guest.keys["clone-1"] and rt._keys is not spare
    assert rt._spare is None and rt._spare_for == ""

    guest.seed = seed("clone-2", standby_of="pool-1a2b")  # too late: the spare is gone
    assert await rt.adopt_seed_identity() is True
    assert rt._keys is guest.keys["clone-2"]


def test_standby_of_names_a_member_or_nothing() -> None:
    base = {"instance_id": "web-1"}
    assert identity.SeedIdentity.from_json({**base, "standby_of": "pool-1"}).standby_of == "pool-1"
    for value in (None, 1, True, "", "x" * 129, ["pool-1"]):
        assert identity.SeedIdentity.from_json({**base, "standby_of": value}).standby_of == ""


async def test_a_spare_still_being_made_is_awaited_and_a_failed_one_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime(tmp_path)
    guest = Guest(monkeypatch)
    guest.seed = seed("pool-1", standby=True)
    assert await rt.adopt_seed_identity() is True
    guest.seed = seed("web-1", standby_of="pool-1")
    assert await rt.adopt_seed_identity() is True
    assert rt._keys is guest.keys["pool-1"] and not rt._keys.done()  # paused mid-making

    guest.seed = seed("pool-2", standby=True)
    assert await rt.adopt_seed_identity() is True
    guest.keys["pool-2"].set_exception(RuntimeError("openssl failed"))
    guest.seed = seed("web-2", standby_of="pool-2")
    assert await rt.adopt_seed_identity() is True
    assert rt._keys is guest.keys["web-2"]


@pytest.mark.parametrize("trouble", ["no entropy", "reseed refused"])
async def test_no_spare_key_without_the_members_own_entropy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, trouble: str
) -> None:
    """Without its own entropy a member's key would be every member's: none is made ahead."""
    rt = runtime(tmp_path)
    guest = Guest(monkeypatch)
    guest.seed = seed(
        "pool-1", standby=True, entropy_=b"" if trouble == "no entropy" else b"m" * 32
    )
    if trouble == "reseed refused":

        def refuse(data: bytes) -> None:
            raise PermissionError("not root")

        monkeypatch.setattr(entropy, "reseed_kernel_rng", refuse)
    with caplog.at_level(logging.INFO, logger="agent"):
        assert await rt.adopt_seed_identity() is True
    assert "pool-1" not in guest.keys
    assert NO_SPARE_KEY in caplog.text  # the fleet pauses it on that, not after its wait
    guest.seed = seed("web-1", standby_of="pool-1")
    monkeypatch.setattr(entropy, "reseed_kernel_rng", lambda data: None)
    assert await rt.adopt_seed_identity() is True
    assert rt._keys is guest.keys["web-1"]


def test_only_a_literal_true_makes_a_standby_seed() -> None:
    base = {"instance_id": "pool-1"}
    assert identity.SeedIdentity.from_json({**base, "standby": True}).standby is True
    for value in ("true", 1, "yes", None):
        assert identity.SeedIdentity.from_json({**base, "standby": value}).standby is False
    assert identity.SeedIdentity.from_json(base).standby is False


async def test_a_failed_warm_up_still_stands_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warm-up connection is only that: when it fails the member stands by all the same."""
    rt = runtime(tmp_path)
    guest = Guest(monkeypatch)

    async def refused(*args: object) -> object:
        raise ValueError("no CA on this seed")

    monkeypatch.setattr(runtime_module, "connect_channel", refused)
    guest.seed = seed("pool-1", standby=True)
    with caplog.at_level(logging.INFO, logger="agent"):
        assert await rt.adopt_seed_identity() is True
        guest.keys["pool-1"].set_result((b"KEY", b"CSR"))
        async with asyncio.timeout(5):
            while SPARE_KEY_READY not in caplog.text:
                await asyncio.sleep(0.01)
    assert "standing by without a warm-up connection: no CA on this seed" in caplog.text


async def test_a_spare_that_cannot_be_made_says_so_on_the_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fleet pauses a member on either console line: a failed key must not leave it
    running until the standby time is up."""
    rt = runtime(tmp_path)
    guest = Guest(monkeypatch)
    guest.seed = seed("pool-1", standby=True)
    with caplog.at_level(logging.INFO, logger="agent"):
        assert await rt.adopt_seed_identity() is True
        guest.warm.set()
        guest.keys["pool-1"].set_exception(RuntimeError("openssl failed"))
        async with asyncio.timeout(5):
            while NO_SPARE_KEY not in caplog.text:
                await asyncio.sleep(0.01)
    assert f"{NO_SPARE_KEY}: openssl failed" in caplog.text
    assert SPARE_KEY_READY not in caplog.text
