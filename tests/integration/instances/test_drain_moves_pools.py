"""Draining a host moves its warm pools: a `pool-move` operation captures a new golden state
on another host, the pool's members are made there (before the old go) and the old state is
deleted; with no other host to take it, the drain answer says so and the members stay."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.fleet import Fleet
from agentic_sandbox.images import ImageStore
from tests.integration.instances.conftest import IMAGE
from tests.integration.instances.test_instances_api import wait_op
from tests.integration.instances.test_loadout_versions import pool_ready
from tests.support.fake_images import publish_fake
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import golden_console_says_done, node_uri


@pytest.fixture
async def two_hosts(tmp_path: Path) -> AsyncIterator[tuple[Running, Fleet]]:
    publish_fake(ImageStore(tmp_path / "data" / "images"), IMAGE, recipe_name="fake")
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        comp = next(c for c in r.server.components if isinstance(c, FleetComponent))
        golden_console_says_done(comp)
        status, host, _ = await r.call(
            "POST", "/api/v2/admin/hosts", json={"name": "far", "uri": node_uri(tmp_path, "far")}
        )
        assert status == 201, host
        yield r, comp.fleet


async def members_on(fleet: Fleet, key: str) -> list[str]:
    return sorted(
        i.record.host
        for i in await fleet.list_instances(include_pooled=True)
        if i.record.pool == key
    )


async def test_a_drain_moves_the_hosts_pools_and_says_when_it_cannot(
    two_hosts: tuple[Running, Fleet],
) -> None:
    r, fleet = two_hosts
    status, op, _ = await r.call("POST", "/api/v2/admin/pools", json={"image": IMAGE, "size": 2})
    assert status == 202, op
    op = await wait_op(r, op)
    assert op["state"] == "succeeded", op
    key = op["subject_id"]
    assert (await pool_ready(r, key, 2))["ready"] == 2
    (old_state,) = [s for s in await fleet.list_states() if s.state_id.startswith(key)]
    there = old_state.host
    elsewhere = "far" if there == "local" else "local"
    assert await members_on(fleet, key) == [there, there]

    status, drained, _ = await r.call("POST", f"/api/v2/admin/hosts/{there}/drain")
    assert status == 200, drained
    assert drained["draining"] is True
    (move,) = drained["pools"]
    assert move["key"] == key and move["state"] == "moving" and move["operation_id"], move
    status, move_op, _ = await r.call("GET", f"/api/v2/admin/operations/{move['operation_id']}")
    assert status == 200 and move_op["kind"] == "pool-move", move_op
    move_op = await wait_op(r, move_op)
    assert move_op["state"] == "succeeded", move_op
    assert move_op["result"]["to"] == elsewhere, move_op
    assert await members_on(fleet, key) == [elsewhere, elsewhere]
    states = {s.state_id: s.host for s in await fleet.list_states()}
    assert old_state.state_id not in states  # the old state went with its members
    assert states[move_op["result"]["state_id"]] == elsewhere
    _, pools, _ = await r.call("GET", "/api/v2/admin/pools")
    (pool,) = [p for p in pools["items"] if p["key"] == key]
    assert pool["ready"] == 2 and pool["last_error"] == "", pool

    # the pool's host drained too, and no third: the drain says so and the members stay
    status, _, _ = await r.call("DELETE", f"/api/v2/admin/hosts/{there}/drain")
    assert status == 200
    status, _, _ = await r.call("POST", f"/api/v2/admin/hosts/{there}/drain")
    assert status == 200
    status, stuck, _ = await r.call("POST", f"/api/v2/admin/hosts/{elsewhere}/drain")
    assert status == 200, stuck
    (move,) = stuck["pools"]
    assert move["state"] == "stuck" and move["operation_id"] is None, move
    assert "no other host" in move["reason"], move
    assert await members_on(fleet, key) == [elsewhere, elsewhere]
    status, again, _ = await r.call("POST", f"/api/v2/admin/hosts/{there}/drain")
    assert status == 200 and again["pools"] == []  # nothing of it left on that host
