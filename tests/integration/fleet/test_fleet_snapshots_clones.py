"""Snapshots, saved states, clones and the warm pool on the test driver."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentic_sandbox.fleet import (
    CloneSpec,
    Conflict,
    Fleet,
    InstanceSpec,
    InstanceState,
    InvalidRequest,
    NotFound,
    Standby,
)
from agentic_sandbox.fleet.index import Entry
from agentic_sandbox.fleet.libvirt.domain import save_record
from agentic_sandbox.fleet.libvirt.domain_xml import parse_record
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import wait_for


async def golden_state(f: Fleet) -> None:
    """A running instance `gold` saved as state `st` (what a pool restores its members from)."""
    await f.create(InstanceSpec(instance_id="gold", image="img"))
    await f.capture_state("gold", "st")


async def test_snapshot_create_list_revert_delete(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="a1", image="img"))
    s = await f.create_snapshot("a1", "s1", description="first")
    assert s.with_memory and s.name == "s1" and s.description == "first"
    again = await f.create_snapshot("a1", "s1")  # idempotent
    assert again.name == "s1"
    with pytest.raises(InvalidRequest):
        await f.create_snapshot("a1", "disk", with_memory=False)  # running: memory only
    await f.create_snapshot("a1", "s2")
    assert [x.name for x in await f.list_snapshots("a1")] == ["s1", "s2"]
    await f.force_off("a1")
    d = await f.create_snapshot("a1", "off")
    assert not d.with_memory
    reverted = await f.revert_snapshot("a1", "s1")
    assert reverted.state is InstanceState.RUNNING
    assert (await f.revert_snapshot("a1", "s2", paused=True)).state is InstanceState.PAUSED
    with pytest.raises(NotFound):
        await f.revert_snapshot("a1", "nope")
    await f.delete_snapshot("a1", "s2")
    await f.delete_snapshot("a1", "s2")  # idempotent
    assert [x.name for x in await f.list_snapshots("a1")] == ["off", "s1"]
    assert "snapshot.reverted" in env.kinds("a1")
    await f.delete("a1")  # with its snapshots
    assert env.domains() == []


async def test_capture_and_clone_under_new_identities(env: Env) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="gold", image="img", loadout="py"))
    st = await f.capture_state("gold", "py-v1")
    assert st.image == "img" and st.loadout == "py"
    assert (await f.get("gold")).state is InstanceState.SHUTOFF
    with pytest.raises(Conflict):
        await f.capture_state("gold", "py-v1")
    c1 = await f.clone_from_state("py-v1", CloneSpec(instance_id="c1", owner="alice"))
    c2 = await f.clone_from_state("py-v1", CloneSpec(instance_id="c2"), paused=True)
    assert c1.state is InstanceState.RUNNING and c2.state is InstanceState.PAUSED
    assert len({c1.record.domain, c2.record.domain, "sbx-gold"}) == 3
    assert c1.record.ssh_port != c2.record.ssh_port
    assert c1.record.overlay != c2.record.overlay
    assert c1.record.origin == "state:py-v1"
    conn = f.hosts["h1"].conn
    assert conn is not None
    d1 = conn.lookupByName("sbx-c1")
    assert d1.UUIDString() != conn.lookupByName("sbx-c2").UUIDString()
    rec = parse_record(d1.XMLDesc(0))
    assert rec is not None and rec.instance_id == "c1" and rec.owner == "alice"
    for iid in ("c1", "c2", "gold"):
        await f.delete(iid)
    await f.delete_state("py-v1")
    assert await f.list_states() == []
    assert everything(env) == {
        "fleet/",
        "fleet/bases/",
        "fleet/bases/img",
        "fleet/bases/img.sha256",
        *POOL_DIRS,
    }


POOL_DIRS = ("fleet/instances/", "fleet/states/")


def everything(env: Env) -> set[str]:
    """Every file under the fleet's data directory, and every volume of its storage pools
    (the test driver keeps overlays and frozen disks as volumes without files)."""
    out = {
        str(p.relative_to(env.root)) + ("/" if p.is_dir() else "") for p in env.data.rglob("*")
    } | {"fleet/"}
    st = env.fleet.hosts["h1"].storage
    assert st is not None
    for kind in ("instances", "states"):
        out |= {f"fleet/{kind}/{n}" for n in st.pool(kind).listVolumes()}
    return out


def states_dir(env: Env) -> set[str]:
    return {
        n.removeprefix("fleet/states/")
        for n in everything(env)
        if n.startswith("fleet/states/") and n != "fleet/states/"
    }


@pytest.mark.parametrize("order", ["clones-first", "source-first"])
async def test_deletes_leave_nothing_in_either_order(env: Env, order: str) -> None:
    """A source with a memory snapshot (a saved state kept running, as the server takes one)
    and two clones restored from it: deleting all three, in either order, and the snapshot's
    state leaves the data directory and the pools as they were before the source was made.
    The state's memory image goes at once; its frozen disk with the last clone backed by it."""
    f = env.fleet
    before = everything(env)
    await f.create(InstanceSpec(instance_id="src", image="img"))
    await f.capture_state("src", "src--s1", keep_running=True)
    await f.create_snapshot("src", "s1")
    for iid in ("c1", "c2"):
        await f.clone_from_state("src--s1", CloneSpec(instance_id=iid))
    assert {"src--s1.save", "src--s1.qcow2"} <= states_dir(env)
    if order == "clones-first":
        for iid in ("c1", "c2", "src"):
            await f.delete(iid)
        await f.delete_state("src--s1")
    else:
        await f.delete_state("src--s1")  # the source goes with its snapshot's state
        await f.delete("src")
        assert states_dir(env) == {"src--s1.qcow2"}, "the clones still run on the frozen disk"
        assert await f.list_states() == []
        await f.delete("c1")
        assert states_dir(env) == {"src--s1.qcow2"}, "c2 still runs on it"
        await f.delete("c2")
    assert everything(env) == before


async def test_frozen_disks_chained_through_a_clone_stay_while_used(env: Env) -> None:
    """A clone's own snapshot is backed by its source's frozen disk: that disk stays while
    anything restored from the clone's state runs, even after source, clone and both states
    are deleted, and goes with the last user — also when found by reconciliation."""
    f = env.fleet
    before = everything(env)
    await f.create(InstanceSpec(instance_id="src", image="img"))
    await f.capture_state("src", "src--s1", keep_running=True)
    await f.clone_from_state("src--s1", CloneSpec(instance_id="c1"))
    await f.capture_state("c1", "c1--s2", keep_running=True)
    await f.clone_from_state("c1--s2", CloneSpec(instance_id="d1"))
    for step in ("src--s1", "src", "c1--s2", "c1"):
        await (f.delete_state(step) if "--" in step else f.delete(step))
    assert states_dir(env) == {"src--s1.qcow2", "c1--s2.qcow2"}
    await f.reconcile()  # nothing in use is an orphan
    assert states_dir(env) == {"src--s1.qcow2", "c1--s2.qcow2"}
    await f.delete("d1")
    assert everything(env) == before


async def test_deleting_a_pools_state_while_its_instances_run(env: Env) -> None:
    f = env.fleet
    before = everything(env)
    await f.create(InstanceSpec(instance_id="gold", image="img"))
    await f.capture_state("gold", "golden")
    await f.delete("gold")
    await f.configure_pool("p1", "golden", 1, wait=True)
    with pytest.raises(Conflict):
        await f.delete_state("golden")  # the pool still keeps clones of it
    taken = await f.take_from_pool("p1", CloneSpec(instance_id="fast-1"))
    assert taken is not None
    await f.configure_pool("p1", "golden", 0)
    await f.delete_state("golden")
    assert states_dir(env) == {"golden.qcow2"}, "fast-1 runs on the frozen disk"
    await f.delete("fast-1")
    await f.drain_pools()
    assert everything(env) == before


async def test_clone_from_snapshot_needs_local_files(env: Env) -> None:
    await env.fleet.create(InstanceSpec(instance_id="a1", image="img"))
    await env.fleet.create_snapshot("a1", "s1")
    with pytest.raises(InvalidRequest):
        await env.fleet.clone_from_snapshot("a1", "s1", CloneSpec(instance_id="b1"))
    assert "b1" not in env.fleet.index


async def test_warm_pool_take_and_refill(env: Env) -> None:
    f = env.fleet
    await golden_state(f)
    status = await f.configure_pool("img-default", "st", 2, wait=True)
    assert status.ready == 2
    pooled = await f.list_instances(include_pooled=True)
    assert len([i for i in pooled if i.record.pool == "img-default"]) == 2
    assert all(i.state is InstanceState.PAUSED for i in pooled if i.record.pool)
    assert [i.instance_id for i in await f.list_instances()] == ["gold"]

    got = await f.take_from_pool("img-default", CloneSpec(instance_id="fast-1", owner="bob"))
    assert got is not None and got.state is InstanceState.RUNNING
    assert got.record.pool is None and got.record.owner == "bob"
    conn = f.hosts["h1"].conn
    assert conn is not None
    rec = parse_record(conn.lookupByName(got.record.domain).XMLDesc(0))
    assert rec is not None and rec.instance_id == "fast-1" and rec.pool is None
    await wait_for(lambda: len(f.pools.slots["img-default"].ready) == 2, what="refill")
    with pytest.raises(Conflict):
        await f.take_from_pool("img-default", CloneSpec(instance_id="fast-1"))

    await f.configure_pool("img-default", "st", 0)
    assert await f.take_from_pool("img-default", CloneSpec(instance_id="fast-2")) is None
    assert [i.instance_id for i in await f.list_instances(include_pooled=True)] == [
        "fast-1",
        "gold",
    ]
    await f.drain_pools()


async def test_a_standby_pool_gives_each_member_a_seed_of_its_own(env: Env) -> None:
    """The server's standby seed goes into each new member (its id, its file), and the local
    file it was written to is gone once the fleet copied it."""
    f = env.fleet
    await golden_state(f)
    asked: list[str] = []
    written: list[Path] = []

    async def seed(member_id: str) -> str:
        asked.append(member_id)
        path = env.root / f"{member_id}.standby.iso"
        path.write_bytes(f"seed of {member_id}".encode())
        written.append(path)
        return str(path)

    status = await f.configure_pool(
        "p1", "st", 2, standby=Standby(seed=seed, ready=(b"ready",)), wait=True
    )
    assert status.ready == 2
    members = [i for i in await f.list_instances(include_pooled=True) if i.record.pool == "p1"]
    assert sorted(i.instance_id for i in members) == sorted(asked)
    for member in members:
        assert member.state is InstanceState.PAUSED and member.record.seed
        assert Path(member.record.seed).read_bytes() == f"seed of {member.instance_id}".encode()
    assert not any(p.exists() for p in written)
    await f.configure_pool("p1", "st", 0)
    await f.drain_pools()


async def test_the_hand_off_seed_is_bound_to_the_member_picked(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bind_seed` hears the id of the member picked, and runs before the seed goes in (what
    it writes is what the member gets); a bind that fails still hands the member off. (The
    test driver has no media change: the seed's copy is recorded instead.)"""
    f = env.fleet
    await golden_state(f)
    await f.configure_pool("p1", "st", 2, wait=True)
    members = list(f.pools.slots["p1"].ready)
    bound: list[str] = []
    copied: list[bytes] = []
    seed = env.root / "hand-off.iso"

    async def set_seed(host: object, entry: object, path: str) -> None:
        copied.append(Path(path).read_bytes())

    monkeypatch.setattr(f.lifecycle, "set_seed_locked", set_seed)

    async def bind(member: str) -> None:
        bound.append(member)
        seed.write_bytes(f"for {member}".encode())

    seed.write_bytes(b"unbound")
    got = await f.take_from_pool(
        "p1", CloneSpec(instance_id="web-1", seed=str(seed)), bind_seed=bind
    )
    assert got is not None and bound == [members[0]]
    assert copied == [f"for {members[0]}".encode()]

    async def broken(member: str) -> None:
        raise OSError("disk full")

    seed.write_bytes(b"unbound")
    got = await f.take_from_pool(
        "p1", CloneSpec(instance_id="web-2", seed=str(seed)), bind_seed=broken
    )
    assert got is not None and got.state is InstanceState.RUNNING
    assert copied[-1] == b"unbound"
    await f.configure_pool("p1", "st", 0)
    await f.drain_pools()


async def test_no_snapshot_or_saved_state_of_a_pool_member(env: Env) -> None:
    """A member's memory may hold the key its agent made standing by: it is never saved."""
    f = env.fleet
    await golden_state(f)
    await f.configure_pool("p1", "st", 1, wait=True)
    member = f.pools.slots["p1"].ready[0]
    with pytest.raises(InvalidRequest, match="member of warm pool 'p1'"):
        await f.create_snapshot(member, "s1")
    with pytest.raises(InvalidRequest, match="member of warm pool 'p1'"):
        await f.capture_state(member, "st2")
    assert await f.list_snapshots(member) == [] and f.states.get("st2") is None
    taken = await f.take_from_pool("p1", CloneSpec(instance_id="web-1"))
    assert taken is not None
    assert (await f.create_snapshot("web-1", "s1")).name == "s1"  # taken: its own instance
    await f.configure_pool("p1", "st", 0)
    await f.drain_pools()


async def test_a_failing_standby_seed_factory_is_the_pools_named_error(env: Env) -> None:
    f = env.fleet
    await golden_state(f)

    async def seed(member_id: str) -> str:
        raise ValueError("the record is too large")

    status = await f.configure_pool(
        "p1", "st", 1, standby=Standby(seed=seed, ready=(b"ready",)), wait=True
    )
    assert status.ready == 0
    assert "standby seed" in status.last_error and "the record is too large" in status.last_error
    assert [i.instance_id for i in await f.list_instances(include_pooled=True)] == ["gold"]
    await f.drain_pools()


@pytest.mark.parametrize("failure", [Conflict("the tray would not open"), OSError("disk full")])
async def test_a_failed_hand_off_turns_the_member_off_and_gives_it_back_its_record(
    env: Env, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """A member whose hand-off fails after its resume (here: the seed's step, after the
    caller's record reached the domain's metadata) is off before its delete comes round, so it
    cannot enroll with the caller's seed; and it is the pool member it was (its pool, no owner)
    in the index and in libvirt's metadata, not a half-made instance of the caller's (a delete
    that failed would leave reconciliation the caller's record)."""
    f = env.fleet
    await golden_state(f)
    await f.configure_pool("p1", "st", 1, wait=True)
    member = f.pools.slots["p1"].ready[0]
    seen: list[tuple[str, bool, InstanceState, str | None, str | None, str | None]] = []
    real_delete = f.lifecycle.delete
    conn = f.hosts["h1"].conn
    assert conn is not None

    async def set_seed(host: object, entry: Entry, path: str) -> None:
        save_record(conn.lookupByName(entry.record.domain), entry.record)  # the caller's
        raise failure

    async def delete(instance_id: str) -> None:
        got = await f.get(instance_id)
        dom = conn.lookupByName(got.record.domain)
        meta = parse_record(dom.XMLDesc(0))
        seen.append(
            (
                instance_id,
                bool(dom.isActive()),  # libvirt's own word
                got.state,
                got.record.pool,
                got.record.owner,
                meta.instance_id if meta is not None else None,
            )
        )
        await real_delete(instance_id)

    monkeypatch.setattr(f.lifecycle, "set_seed_locked", set_seed)
    monkeypatch.setattr(f.lifecycle, "delete", delete)
    seed = env.root / "hand-off.iso"
    seed.write_bytes(b"seed")
    got = await f.take_from_pool(
        "p1", CloneSpec(instance_id="web-1", owner="alice", seed=str(seed))
    )
    assert got is None
    await wait_for(lambda: len(seen) == 1, what="the failed member's delete")
    assert seen == [(member, False, InstanceState.SHUTOFF, "p1", "", member)]
    with pytest.raises(NotFound):
        await f.get("web-1")
    await f.configure_pool("p1", "st", 0)
    await f.drain_pools()


def test_a_standby_says_which_console_lines_end_its_wait() -> None:
    async def seed(member_id: str) -> str:
        return ""

    assert Standby(seed=seed, ready=(b"ready", b"none")).ready == (b"ready", b"none")
    for bad in (b"ready", (), (b"",), ("ready",)):
        with pytest.raises(InvalidRequest, match=r"Standby\.ready"):
            Standby(seed=seed, ready=bad)  # type: ignore[arg-type]


async def test_a_member_never_paused_is_replaced_not_taken_back(env: Env) -> None:
    """A member left running (the server stopped while it warmed up) is not taken into the
    pool as it is: it is deleted, and the refill makes a new one. The member a refill is
    making right now is left alone."""
    f = env.fleet
    await golden_state(f)
    await f.configure_pool("p1", "st", 2, wait=True)
    slot = f.pools.slots["p1"]
    stale, making = slot.ready.pop(), slot.ready.pop()  # as a new server finds them
    await f.lifecycle.resume(stale)
    await f.lifecycle.resume(making)
    slot.filling = making
    status = await f.configure_pool("p1", "st", 2, wait=True)
    pooled = [i.instance_id for i in await f.list_instances(include_pooled=True)]
    assert stale not in pooled and stale not in slot.ready
    assert making in pooled and making not in slot.ready  # its refill adds it when it is paused
    assert status.ready == 2
    slot.filling = None
    await f.delete(making)
    await f.configure_pool("p1", "st", 0)
    await f.drain_pools()


async def test_an_unreadable_console_pauses_the_member_rather_than_losing_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = env.fleet
    await f.create(InstanceSpec(instance_id="gold", image="img"))

    async def unreadable(instance_id: str, offset: int = 0) -> bytes:
        raise NotFound("the serial log is gone")

    monkeypatch.setattr(f.lifecycle, "read_serial_log", unreadable)
    config = f.pools.ctx.config
    assert config.pool_standby_wait_s >= 10
    started = time.monotonic()
    # returns at once (no wait for the standby time), without raising into the refill
    await f.pools._stand_by("gold", (b"ready",), config)
    assert time.monotonic() - started < 2


async def test_a_member_is_paused_on_either_console_line_even_split_across_reads(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent says it made its spare key, or that it makes none: either ends the wait at
    once (a member with no spare must not keep its guest running for the whole standby time),
    also when the line arrives in two reads of the console."""
    f = env.fleet
    await f.create(InstanceSpec(instance_id="gold", image="img"))
    config = f.pools.ctx.config
    lines = (b"agentic-sandbox: spare key ready", b"agentic-sandbox: no spare key")
    for said in lines:
        console = b"boot noise\n" + said + b" (812 ms)\n"
        reads = [console[:20], console[20:30], console[30:], b""]

        async def read(instance_id: str, offset: int = 0, reads: list[bytes] = reads) -> bytes:
            return reads.pop(0) if reads else b""

        monkeypatch.setattr(f.lifecycle, "read_serial_log", read)
        started = time.monotonic()
        await f.pools._stand_by("gold", lines, config)
        assert time.monotonic() - started < 2 and reads == [b""]
