"""Versioned loadouts over the admin API of a real server (fleet on libvirt's test driver):
the shipped files as version 1, idempotent content-addressed saves, 422 naming the field,
compare-and-set activation (409 when the active version moved), `extends` pinned to the
parent's active version, instances keeping the exact version they were made from, warm pools
keyed by version, and owners and roles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.images import ImageStore
from tests.integration.instances.conftest import IMAGE
from tests.integration.instances.test_instances_api import create, wait_op
from tests.support.fake_images import publish_fake
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import golden_console_says_done, node_uri

LOADOUTS = "/api/v2/admin/loadouts"
WEB_V1 = {"extends": "minimal", "description": "web v1", "resources": {"cpus": 1}}
WEB_V2 = {"extends": "minimal", "description": "web v2", "resources": {"cpus": 2}}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Running]:
    """As the instances' `fleet_server`, and a warm pool's golden VM can be prepared."""
    data = tmp_path / "data"
    publish_fake(ImageStore(data / "images"), IMAGE, recipe_name="fake")
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        golden_console_says_done(
            next(c for c in r.server.components if isinstance(c, FleetComponent))
        )
        yield r


async def save(
    r: Running, name: str, spec: dict[str, Any], token: str | None = None, **extra: Any
) -> tuple[int, dict[str, Any]]:
    status, body, _ = await r.call(
        "POST", LOADOUTS, token=token, json={"name": name, "spec": spec, **extra}
    )
    return status, body


async def activate(
    r: Running, name: str, version: int, expected: int, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    status, body, _ = await r.call(
        "POST",
        f"{LOADOUTS}/{name}/activate",
        token=token,
        json={"version": version, "expected_version": expected},
    )
    return status, body


async def versions(r: Running, name: str, token: str | None = None) -> dict[str, Any]:
    status, body, _ = await r.call("GET", f"{LOADOUTS}/{name}/versions", token=token)
    assert status == 200, body
    return body


async def test_the_shipped_files_are_version_1_of_their_names(server: Running) -> None:
    r = server
    status, listing, _ = await r.call("GET", LOADOUTS)
    assert status == 200
    assert {(i["name"], i["version"], i["shared"]) for i in listing["items"]} >= {
        ("minimal", 1, True),
        ("dev", 1, True),
        ("reviewer", 1, True),
    }
    dev = await versions(r, "dev")
    assert dev["active_version"] == 1 and dev["shared"] and dev["owner"] == "system"
    (v1,) = dev["items"]
    assert v1["version"] == 1 and v1["active"] and len(v1["digest"]) == 64
    assert v1["extends"] == {"name": "minimal", "version": 1}
    assert v1["spec"]["packages"] == ["git", "build-essential", "tmux", "curl", "jq"]
    assert v1["resolved"]["task_runner"]["user"] == "agent"  # from minimal
    status, one, _ = await r.call("GET", f"{LOADOUTS}/dev/versions/1")
    assert status == 200 and one == v1
    for missing in ("2", "x", "-1"):
        status, body, _ = await r.call("GET", f"{LOADOUTS}/dev/versions/{missing}")
        assert status == 404, (missing, body)


async def test_saving_identical_content_is_idempotent_and_changed_content_a_new_version(
    server: Running,
) -> None:
    r = server
    status, first = await save(r, "web", WEB_V1)
    assert status == 201 and first["created"], first
    assert (first["version"], first["active"]) == (1, True)  # the first save is active at once
    # the same content, keys in another order and the name spelled out: the same version
    again = {"resources": {"cpus": 1}, "description": "web v1", "extends": "minimal"}
    status, same = await save(r, "web", {**again, "name": "web"})
    assert status == 200 and not same["created"], same
    assert (same["version"], same["digest"]) == (1, first["digest"])
    status, second = await save(r, "web", WEB_V2)
    assert status == 201 and second["version"] == 2 and second["digest"] != first["digest"]
    assert not second["active"]  # a save never moves the active version
    status, back = await save(r, "web", WEB_V1)  # old content again: its old version
    assert status == 200 and back["version"] == 1
    listing = await versions(r, "web")
    assert [(v["version"], v["active"]) for v in listing["items"]] == [(1, True), (2, False)]
    assert listing["owner"] == "admin" and not listing["shared"]
    status, active, _ = await r.call("GET", f"{LOADOUTS}/web")
    assert (active["version"], active["description"], active["resources"]["cpus"]) == (
        1,
        "web v1",
        1,
    )


async def test_a_bad_spec_is_422_naming_the_field_and_saves_nothing(server: Running) -> None:
    r = server
    cases: list[tuple[dict[str, Any], str]] = [
        ({"resources": {"cpus": 0}}, "body.spec.resources.cpus"),
        ({"bogus": 1}, "body.spec.bogus"),
        ({"extends": "no-such-loadout"}, "body.spec.extends"),
        ({"packages": "git"}, "body.spec.packages"),
        ({"network": "everywhere"}, "body.spec.network"),
        ({"name": "other"}, "body.spec.name"),
        ({"budgets": {"defaults": {"timeout_seconds": 2**60}}}, "body.spec.budgets"),
        # valid, but no canonical JSON holds an integer beyond 2**53
        (
            {
                "skills": [
                    {
                        "id": "s",
                        "name": "s",
                        "description": "s",
                        "input_schema": {"maxLength": 2**60},
                    }
                ]
            },
            "body.spec",
        ),
    ]
    for spec, field in cases:
        status, body = await save(r, "bad", spec)
        assert status == 422, (spec, body)
        assert body["errors"][0]["field"].startswith(field), (spec, body)
        assert field in body["detail"], (spec, body)
    status, body, _ = await r.call("POST", LOADOUTS, json={"name": "Bad Name!", "spec": {}})
    assert status == 422 and body["errors"][0]["field"] == "body.name", body
    status, body, _ = await r.call("GET", f"{LOADOUTS}/bad/versions")
    assert status == 404, body


async def test_activation_is_compare_and_set(server: Running) -> None:
    r = server
    await save(r, "web", WEB_V1)
    await save(r, "web", WEB_V2)
    status, body = await activate(r, "web", 2, 1)
    assert status == 200 and body == {"name": "web", "active_version": 2, "previous_version": 1}
    # someone who still believes 1 is active: refused, told which one is
    status, body = await activate(r, "web", 1, 1)
    assert status == 409 and body["code"] == "loadout-version-moved", body
    assert body["active_version"] == 2 and "is 2, not 1" in body["detail"]
    assert (await versions(r, "web"))["active_version"] == 2
    status, body = await activate(r, "web", 9, 2)
    assert status == 422 and body["errors"][0]["field"] == "body.version", body
    # two racing activations from the same expected version: exactly one wins
    await save(r, "web", {**WEB_V2, "description": "web v3"})
    results = await asyncio.gather(activate(r, "web", 1, 2), activate(r, "web", 3, 2))
    assert sorted(s for s, _ in results) == [200, 409], results
    winner = next(b for s, b in results if s == 200)
    assert (await versions(r, "web"))["active_version"] == winner["active_version"]


async def test_extends_resolves_to_the_parents_active_version_at_save_time(
    server: Running,
) -> None:
    r = server
    status, child1 = await save(r, "child", {"extends": "minimal", "packages": []})
    assert child1["extends"] == {"name": "minimal", "version": 1}
    status, minimal2 = await save(r, "minimal", {"description": "minimal, v2", "sudo": True})
    assert status == 201 and minimal2["version"] == 2, minimal2
    # not active yet: the same child content is still the same version
    status, same = await save(r, "child", {"extends": "minimal", "packages": []})
    assert status == 200 and same["version"] == 1
    assert (await activate(r, "minimal", 2, 1))[0] == 200
    # the parent moved: the same text now means other content, a new version pinned to it
    status, child2 = await save(r, "child", {"extends": "minimal", "packages": []})
    assert status == 201 and child2["version"] == 2, child2
    assert child2["extends"] == {"name": "minimal", "version": 2}
    assert child2["resolved"]["sudo"] is True and child1["resolved"]["sudo"] is False
    status, old, _ = await r.call("GET", f"{LOADOUTS}/child/versions/1")
    assert old["resolved"]["sudo"] is False  # versions never change


async def test_an_instance_keeps_its_version_when_the_active_one_moves(server: Running) -> None:
    r = server
    await save(r, "web", WEB_V1)
    _, v2 = await save(r, "web", WEB_V2)
    op = await create(r, {"id": "web-a", "image": IMAGE, "loadout": "web", "wait_ready": False})
    assert op["state"] == "succeeded", op
    status, a, _ = await r.call("GET", "/api/v2/admin/instances/web-a")
    assert (a["loadout"], a["loadout_version"], a["vcpus"]) == ("web", 1, 1), a
    assert (await activate(r, "web", 2, 1))[0] == 200
    status, a_after, _ = await r.call("GET", "/api/v2/admin/instances/web-a")
    assert (a_after["loadout_version"], a_after["loadout_digest"], a_after["vcpus"]) == (
        1,
        a["loadout_digest"],
        1,
    )
    op = await create(r, {"id": "web-b", "image": IMAGE, "loadout": "web", "wait_ready": False})
    assert op["state"] == "succeeded", op
    status, b, _ = await r.call("GET", "/api/v2/admin/instances/web-b")
    assert (b["loadout_version"], b["loadout_digest"], b["vcpus"]) == (2, v2["digest"], 2), b
    pinned = {"id": "web-c", "image": IMAGE, "loadout": "web", "loadout_version": 1}
    op = await create(r, {**pinned, "wait_ready": False})
    status, c, _ = await r.call("GET", "/api/v2/admin/instances/web-c")
    assert (c["loadout_version"], c["vcpus"]) == (1, 1), c
    status, body, _ = await r.call(
        "POST",
        "/api/v2/admin/instances",
        json={**pinned, "id": "web-d", "loadout_version": 7, "wait_ready": False},
    )
    assert status == 422 and body["errors"][0]["field"] == "body.loadout_version", body


async def pool_ready(r: Running, key: str, want: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        _, pools, _ = await r.call("GET", "/api/v2/admin/pools")
        pool = next(p for p in pools["items"] if p["key"] == key)
        if pool["ready"] >= want or time.monotonic() > deadline:
            return pool
        await asyncio.sleep(0.2)


async def test_a_warm_pool_is_of_one_loadout_version(server: Running) -> None:
    r = server
    await save(r, "web", WEB_V1)
    await save(r, "web", WEB_V2)
    status, op, _ = await r.call(
        "POST", "/api/v2/admin/pools", json={"image": IMAGE, "loadout": "web", "size": 1}
    )
    assert status == 202, op
    op = await wait_op(r, op)
    assert op["state"] == "succeeded", op
    pool = await pool_ready(r, op["subject_id"], 1)
    assert (pool["loadout"], pool["loadout_version"], pool["ready"]) == ("web", 1, 1), pool

    assert (await activate(r, "web", 2, 1))[0] == 200
    # the active version is 2 now: there is no pool of it; the pool of 1 is untouched
    status, body, _ = await r.call(
        "POST",
        "/api/v2/admin/instances",
        json={"id": "p-2", "image": IMAGE, "loadout": "web", "from_pool": True},
    )
    assert status == 422 and body["errors"][0]["field"] == "body.from_pool", body
    assert "version 2" in body["detail"]
    status, pools, _ = await r.call("GET", "/api/v2/admin/pools")
    assert [(p["key"], p["loadout_version"]) for p in pools["items"]] == [(pool["key"], 1)]
    body = {"id": "p-1", "image": IMAGE, "loadout": "web", "loadout_version": 1}
    op = await create(r, {**body, "from_pool": True, "wait_ready": False})
    assert op["state"] == "succeeded", op
    status, inst, _ = await r.call("GET", "/api/v2/admin/instances/p-1")
    assert (inst["loadout"], inst["loadout_version"]) == ("web", 1), inst
    # a pool of version 2 is another pool
    status, op2, _ = await r.call(
        "POST",
        "/api/v2/admin/pools",
        json={"image": IMAGE, "loadout": "web", "loadout_version": 2, "size": 0},
    )
    assert status == 202 and op2["subject_id"] != pool["key"], op2


async def test_a_create_takes_from_the_matching_pool_unless_it_asks_otherwise(
    server: Running,
) -> None:
    r = server
    await save(r, "web", WEB_V1)
    status, op, _ = await r.call(
        "POST", "/api/v2/admin/pools", json={"image": IMAGE, "loadout": "web", "size": 1}
    )
    assert status == 202, op
    assert (await wait_op(r, op))["state"] == "succeeded"
    await pool_ready(r, op["subject_id"], 1)
    web = {"image": IMAGE, "loadout": "web", "wait_ready": False}
    cases = [
        ({"id": "d-pool", **web}, "pool"),  # nothing asked for that a member lacks
        ({"id": "d-cold", **web, "from_pool": False}, "image"),  # told to boot
        ({"id": "d-cpus", **web, "resources": {"cpus": 2}}, "image"),  # a member has 1
        ({"id": "d-min", **web, "loadout": "minimal"}, "image"),  # no pool of minimal
    ]
    for body, source in cases:
        op = await create(r, body)
        assert op["state"] == "succeeded", op
        assert op["result"]["source"] == source, (body, op["result"])


async def test_owners_and_roles(server: Running) -> None:
    r = server
    alice = await r.make_token("alice", "operator")
    bob = await r.make_token("bob", "operator")
    vera = await r.make_token("vera", "viewer")

    status, mine = await save(r, "alice-lo", WEB_V1, alice)
    assert status == 201 and mine["created_by"] == "alice", mine
    assert (await versions(r, "alice-lo", alice))["owner"] == "alice"
    # bob and the viewer see nothing of it
    for token in (bob, vera):
        status, body, _ = await r.call("GET", f"{LOADOUTS}/alice-lo/versions", token=token)
        assert status == 404, body
        status, body, _ = await r.call("GET", f"{LOADOUTS}/alice-lo", token=token)
        assert status == 404, body
        status, listing, _ = await r.call("GET", LOADOUTS, token=token)
        assert "alice-lo" not in {i["name"] for i in listing["items"]}
        assert "minimal" in {i["name"] for i in listing["items"]}  # shared: everyone reads
    status, body = await save(r, "alice-lo", WEB_V2, bob)
    assert status == 409 and body["code"] == "loadout-name-taken", body
    status, body = await activate(r, "alice-lo", 1, 1, bob)
    assert status == 404, body
    status, body, _ = await r.call(
        "POST",
        "/api/v2/admin/instances",
        token=bob,
        json={"id": "bob-1", "image": IMAGE, "loadout": "alice-lo", "wait_ready": False},
    )
    assert status == 422 and body["errors"][0]["field"] == "body.loadout", body
    # viewers only read
    status, body = await save(r, "vera-lo", WEB_V1, vera)
    assert status == 403 and body["code"] == "forbidden-role", body
    status, body = await activate(r, "minimal", 1, 1, vera)
    assert status == 403, body
    # shared loadouts: operators read them, only admins change them or save shared ones
    status, body = await save(r, "minimal", {"description": "mine now"}, alice)
    assert status == 403, body
    status, body = await activate(r, "minimal", 1, 1, alice)
    assert status == 403, body
    status, body = await save(r, "team", WEB_V1, alice, shared=True)
    assert status == 403, body
    status, team = await save(r, "team", WEB_V1, shared=True)
    assert status == 201, team
    team_doc = await versions(r, "team", bob)
    assert team_doc["shared"] and team_doc["owner"] == "system"
    # alice changes her own; the admin sees and changes everything
    assert (await save(r, "alice-lo", WEB_V2, alice))[0] == 201
    assert (await activate(r, "alice-lo", 2, 1, alice))[0] == 200
    assert (await activate(r, "alice-lo", 1, 2))[0] == 200
    assert (await versions(r, "alice-lo"))["active_version"] == 1
    want = {("loadout.save", "alice-lo"), ("loadout.activate", "alice-lo")}
    deadline = time.monotonic() + 10
    while True:  # the audit log is written behind
        status, audit, _ = await r.call("GET", "/api/v2/admin/audit?subject_type=loadout")
        actions = {(a["action"], a["subject_id"]) for a in audit["items"]}
        if want <= actions or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert want <= actions, actions
