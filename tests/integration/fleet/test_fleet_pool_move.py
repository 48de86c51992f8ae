"""A warm pool given a state on another host (how a drain moves it): new members are made
there first, each retires an old one, so the pool never holds fewer than its size; when the
new host cannot make them, the old members stay and the pool says why."""

from __future__ import annotations

import asyncio

from agentic_sandbox.fleet import CloneSpec, HostSpec, InstanceSpec, InstanceState
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import node_uri, wait_for


async def two_states(env: Env) -> None:
    f = env.fleet
    await f.add_host(HostSpec(name="h2", uri=node_uri(env.root, "h2")))
    await f.import_image("img", str(env.root / "img.qcow2"), host="h2")
    await f.create(InstanceSpec(instance_id="gold1", image="img", host="h1"))
    await f.capture_state("gold1", "st1")
    await f.create(InstanceSpec(instance_id="gold2", image="img", host="h2"))
    await f.capture_state("gold2", "st2")
    for gold in ("gold1", "gold2"):
        await f.delete(gold)


def members(env: Env, key: str) -> dict[str, str]:
    return {
        e.record.instance_id: e.record.host
        for e in env.fleet.index.values()
        if e.record.pool == key and e.state is InstanceState.PAUSED
    }


async def test_a_pool_moves_to_its_new_state_s_host_without_dropping_below_size(
    env: Env,
) -> None:
    f = env.fleet
    await two_states(env)
    await f.configure_pool("p", "st1", 3, wait=True)
    old = members(env, "p")
    assert set(old.values()) == {"h1"} and len(old) == 3

    lowest = 3
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal lowest
        while not stop.is_set():
            lowest = min(lowest, len(members(env, "p")))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        status = await f.configure_pool("p", "st2", 3, wait=True)
    finally:
        stop.set()
        await watcher
    assert lowest >= 3, "the pool dropped below its size while it moved"
    now = members(env, "p")
    assert set(now.values()) == {"h2"} and len(now) == 3, now
    assert not set(now) & set(old)
    assert (status.ready, status.retiring, status.state_id) == (3, 0, "st2")
    assert not [d for d in env.domains("h1") if d.startswith("sbx-pool-")]
    got = await f.take_from_pool("p", CloneSpec(instance_id="fast-1"))
    assert got is not None and got.record.host == "h2"
    await f.drain_pools()
    await f.delete("fast-1")


async def test_a_move_that_cannot_make_members_leaves_the_old_ones(env: Env) -> None:
    f = env.fleet
    await two_states(env)
    await f.configure_pool("p", "st1", 2, wait=True)
    old = members(env, "p")
    env.faults.fail_at.add("restoring")  # no clone can be made anywhere now
    status = await f.configure_pool("p", "st2", 2, wait=True)
    assert members(env, "p") == old
    assert (status.ready, status.retiring) == (2, 2), status
    assert status.last_error, status
    # the old members are still handed out rather than none at all
    env.faults.fail_at.clear()
    got = await f.take_from_pool("p", CloneSpec(instance_id="fast-1"))
    assert got is not None and got.record.host == "h1"
    await wait_for(lambda: set(members(env, "p").values()) == {"h2"}, what="the move")
    await wait_for(lambda: len(members(env, "p")) == 2, what="the refill")
    await f.drain_pools()
    await f.delete("fast-1")
