"""The admin API over the fleet (libvirt's test driver): create, lifecycle, snapshots, clones,
hosts, errors, ownership, events and audit."""

from __future__ import annotations

import asyncio
from typing import Any

from agentic_sandbox.broker.instances import FleetComponent
from tests.integration.instances.conftest import IMAGE
from tests.support.inproc_server import Running


async def wait_op(r: Running, op: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    for _ in range(200):
        if op["state"] in ("succeeded", "failed", "canceled"):
            return op
        await asyncio.sleep(0.05)
        status, op, _ = await r.call("GET", f"/api/v2/admin/operations/{op['id']}", token=token)
        assert status == 200, op
    raise AssertionError(f"operation did not end: {op}")


async def create(r: Running, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    status, op, _ = await r.call("POST", "/api/v2/admin/instances", token=token, json=body)
    assert status == 202, op
    assert op["kind"] == "provision" and op["subject_id"] == body["id"]
    return await wait_op(r, op, token)


async def test_create_lifecycle_delete(fleet_server: Running) -> None:
    r = fleet_server
    op = await create(r, {"id": "vm-1", "image": IMAGE, "wait_ready": False})
    assert op["state"] == "succeeded", op
    names = [s["name"] for s in op["stages"]]
    assert names[0] == "seed" and names[-1] == "ready"
    assert {"placing", "disk", "defining", "booting"} <= set(names)
    assert all(s["seconds"] is not None for s in op["stages"])

    status, inst, _ = await r.call("GET", "/api/v2/admin/instances/vm-1")
    assert status == 200
    assert inst["state"] == "running" and inst["host"] == "local"
    assert inst["owner"] == "admin" and inst["ssh_port"]
    assert inst["network_policy"] == "isolated" and inst["loadout"] == "minimal"

    for action, expected in (
        ("suspend", "paused"),
        ("resume", "running"),
        ("force-off", "shutoff"),
        ("start", "running"),
        ("stop", "shutoff"),
    ):
        status, body, _ = await r.call("POST", f"/api/v2/admin/instances/vm-1/{action}", json={})
        assert status == 200, (action, body)
        assert body["state"] == expected, (action, body)

    status, _, _ = await r.call("DELETE", "/api/v2/admin/instances/vm-1")
    assert status == 204
    status, _, _ = await r.call("GET", "/api/v2/admin/instances/vm-1")
    assert status == 404
    leftovers = list((r.svc.settings.data_dir / "fleet" / "instances").glob("*vm-1*"))
    assert leftovers == []
    status, events, _ = await r.call("GET", "/api/v1/events?instance_id=vm-1&limit=200")
    types = [e["type"] for e in events["items"]]
    assert types[0] == "instance.provisioning" and "instance.ready" in types
    assert "instance.deleted" in types
    status, audit, _ = await r.call(
        "GET", "/api/v2/admin/audit?subject_type=instance&subject_id=vm-1"
    )
    transitions = [(a["from_state"], a["to_state"]) for a in audit["items"] if a["to_state"]]
    assert (None, "provisioning") in transitions and transitions[-1][1] == "deleted"


async def test_memory_snapshot_and_clone(fleet_server: Running) -> None:
    r = fleet_server
    assert (await create(r, {"id": "src", "image": IMAGE, "wait_ready": False}))[
        "state"
    ] == "succeeded"
    status, snap, _ = await r.call(
        "POST", "/api/v2/admin/instances/src/snapshots", json={"name": "s1", "memory": True}
    )
    assert status == 201 and snap["kind"] == "memory", snap
    status, _body, _ = await r.call(
        "POST", "/api/v2/admin/instances/src/snapshots", json={"name": "s1"}
    )
    assert status == 409
    status, op, _ = await r.call(
        "POST",
        "/api/v2/admin/instances/src/clone",
        json={"new_id": "copy", "snapshot": "s1", "wait_ready": False},
    )
    assert status == 202
    op = await wait_op(r, op)
    assert op["state"] == "succeeded", op
    for iid in ("src", "copy"):
        status, inst, _ = await r.call("GET", f"/api/v2/admin/instances/{iid}")
        assert inst["state"] == "running", inst
    _, src, _ = await r.call("GET", "/api/v2/admin/instances/src")
    _, copy, _ = await r.call("GET", "/api/v2/admin/instances/copy")
    assert src["ssh_port"] != copy["ssh_port"]
    status, listing, _ = await r.call("GET", "/api/v2/admin/instances/src/snapshots")
    assert [s["name"] for s in listing["items"]] == ["s1"]
    status, _, _ = await r.call("POST", "/api/v2/admin/instances/src/snapshots/s1/revert")
    assert status == 200


def fleet_files(r: Running) -> set[str]:
    """Files and (test-driver) volumes in the fleet's instance and state stores."""
    comp = r.svc.settings.data_dir / "fleet"
    out = {
        f"{p.parent.name}/{p.name}"
        for kind in ("instances", "states")
        for p in (comp / kind).iterdir()
    }
    fleet = next(c for c in r.server.components if isinstance(c, FleetComponent)).fleet
    storage = fleet.hosts["local"].storage
    assert storage is not None
    for kind in ("instances", "states"):
        out |= {f"{kind}/{n}" for n in storage.pool(kind).listVolumes()}
    return out


async def test_deleting_a_source_before_its_clones_leaves_nothing(fleet_server: Running) -> None:
    """The snapshot's state is not left behind when its source goes first (it used to fail
    while the clones ran, the error was ignored and the row dropped)."""
    r = fleet_server
    before = fleet_files(r)
    assert (await create(r, {"id": "src2", "image": IMAGE, "wait_ready": False}))[
        "state"
    ] == "succeeded"
    status, _, _ = await r.call(
        "POST", "/api/v2/admin/instances/src2/snapshots", json={"name": "s1", "memory": True}
    )
    assert status == 201
    for new in ("c-1", "c-2"):
        status, op, _ = await r.call(
            "POST",
            "/api/v2/admin/instances/src2/clone",
            json={"new_id": new, "snapshot": "s1", "wait_ready": False},
        )
        assert (await wait_op(r, op))["state"] == "succeeded"
    assert {"states/src2--s1.save", "states/src2--s1.qcow2"} <= fleet_files(r)
    status, _, _ = await r.call("DELETE", "/api/v2/admin/instances/src2")
    assert status == 204
    left = fleet_files(r) - before
    assert "states/src2--s1.save" not in left, "the memory image goes with its snapshot"
    assert "states/src2--s1.qcow2" in left, "the clones run on the frozen disk"
    for new in ("c-1", "c-2"):
        status, _, _ = await r.call("DELETE", f"/api/v2/admin/instances/{new}")
        assert status == 204
    assert fleet_files(r) == before


async def test_bad_requests_name_the_problem(fleet_server: Running) -> None:
    r = fleet_server
    cases = [
        ({"id": "Bad_Name", "image": IMAGE}, 422, "body.id"),
        ({"id": "ok-1", "image": IMAGE, "loadout": "nope"}, 422, "body.loadout"),
        ({"id": "ok-1", "image": "no-such-image"}, 422, "body.image"),
        ({"id": "ok-1", "image": IMAGE, "resources": {"cpus": 0}}, 422, "body.resources.cpus"),
        ({"id": "ok-1", "image": IMAGE, "ssh_keys": ["not a key"]}, 422, "body.ssh_keys.0"),
        ({"id": "ok-1", "from_snapshot": "x/y"}, 404, "instance"),
        # the dev loadout installs packages at first boot: known from the request, refused
        # before anything is made (not an operation that fails later)
        (
            {"id": "ok-1", "image": IMAGE, "loadout": "dev", "network": "isolated"},
            422,
            "body.network",
        ),
        (
            {"id": "ok-1", "image": IMAGE, "loadout": "dev", "network": "allowlist"},
            422,
            "body.network",
        ),
    ]
    for body, status_expected, fragment in cases:
        status, problem, _ = await r.call("POST", "/api/v2/admin/instances", json=body)
        assert status == status_expected, (body, problem)
        assert fragment in problem["detail"], (body, problem)
    status, rows, _ = await r.call("GET", "/api/v2/admin/instances")
    assert rows["items"] == []


async def test_failed_provision_leaves_nothing(fleet_server: Running) -> None:
    r = fleet_server
    # a host that does not exist: the fleet refuses at placing
    op = await create(r, {"id": "iso-2", "image": IMAGE, "host": "elsewhere", "wait_ready": False})
    assert op["state"] == "failed" and op["error"]["stage"] == "placing", op
    _status, rows, _ = await r.call("GET", "/api/v2/admin/instances")
    assert rows["items"] == []
    fleet_dir = r.svc.settings.data_dir / "fleet" / "instances"
    assert not list(fleet_dir.glob("*iso-*"))
    assert not list((r.svc.settings.data_dir / "provision" / "seeds").glob("*"))


async def test_ownership_and_roles(fleet_server: Running) -> None:
    r = fleet_server
    alice = await r.make_token("alice", "operator")
    bob = await r.make_token("bob", "operator")
    viewer = await r.make_token("vera", "viewer")
    op = await create(r, {"id": "alice-vm", "image": IMAGE, "wait_ready": False}, token=alice)
    assert op["state"] == "succeeded"
    status, _, _ = await r.call("GET", "/api/v2/admin/instances/alice-vm", token=bob)
    assert status == 404
    status, _, _ = await r.call("DELETE", "/api/v2/admin/instances/alice-vm", token=bob)
    assert status == 404
    status, _, _ = await r.call("GET", f"/api/v2/admin/operations/{op['id']}", token=bob)
    assert status == 404
    status, listing, _ = await r.call("GET", "/api/v2/admin/instances", token=bob)
    assert listing["items"] == []
    status, _, _ = await r.call(
        "POST", "/api/v2/admin/instances", token=viewer, json={"id": "v-1", "image": IMAGE}
    )
    assert status == 403
    status, listing, _ = await r.call("GET", "/api/v2/admin/instances")
    assert [i["id"] for i in listing["items"]] == ["alice-vm"]
    status, _, _ = await r.call(
        "POST", "/api/v2/admin/instances", token=alice, json={"id": "alice-vm", "image": IMAGE}
    )
    assert status == 409


async def test_hosts_and_placement(fleet_server: Running, tmp_path: Any) -> None:
    from tests.support.libvirt_testdriver import node_uri

    r = fleet_server
    uri = node_uri(tmp_path, "second", memory_mib=65536)
    status, host, _ = await r.call(
        "POST",
        "/api/v2/admin/hosts",
        json={
            "name": "second",
            "uri": uri,
            "labels": {"zone": "b"},
            "ssh_port_range": [43100, 43199],
        },
    )
    assert status == 201 and host["state"] == "reachable", host
    status, hosts, _ = await r.call("GET", "/api/v2/admin/hosts")
    assert {h["name"] for h in hosts["items"]} == {"local", "second"}
    op = await create(
        r, {"id": "zoned", "image": IMAGE, "host_labels": {"zone": "b"}, "wait_ready": False}
    )
    assert op["state"] == "succeeded", op["error"]
    _, inst, _ = await r.call("GET", "/api/v2/admin/instances/zoned")
    assert inst["host"] == "second"
    status, body, _ = await r.call("DELETE", "/api/v2/admin/hosts/second")
    assert status == 409, body  # it still has an instance
    status, _, _ = await r.call(
        "POST", "/api/v2/admin/hosts", json={"name": "x", "uri": "http://no"}
    )
    assert status == 422


async def test_a_hosts_control_address_is_where_the_gateway_listens_and_is_kept(
    tmp_path: Any,
) -> None:
    """A host's guests reach the server at its control_address: one the guest link gateway
    does not listen on is refused naming the field and the setting; an accepted one leads
    that host's guest forwards and is kept across a restart, with accel, files, data_dir
    (and a drain)."""
    from agentic_sandbox.images import ImageStore
    from tests.support.fake_images import publish_fake
    from tests.support.inproc_server import make_settings, start_server
    from tests.support.libvirt_testdriver import node_uri

    publish_fake(ImageStore(tmp_path / "data" / "images"), IMAGE, recipe_name="fake")
    settings = make_settings(
        tmp_path,
        libvirt_uri=node_uri(tmp_path, "local"),
        kvm_probe=False,
        guest_link_addresses=["127.0.0.2"],
    )
    uri = node_uri(tmp_path, "far")
    body = {
        "name": "far",
        "uri": uri,
        "labels": {"net": "far"},
        "accel": "tcg",
        "files": "remote",
        "data_dir": str(tmp_path / "far-data"),
    }
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        for bad, says in (("127.0.0.3", "guest_link_addresses"), ("far.example", "IP address")):
            status, problem, _ = await r.call(
                "POST", "/api/v2/admin/hosts", json={**body, "control_address": bad}
            )
            assert status == 422, problem
            assert problem["errors"][0]["field"] == "body.control_address", problem
            assert says in problem["detail"], problem
        status, listing, _ = await r.call("GET", "/api/v2/admin/hosts")
        assert [h["name"] for h in listing["items"]] == ["local"]  # nothing half-added
        status, host, _ = await r.call(
            "POST", "/api/v2/admin/hosts", json={**body, "control_address": "127.0.0.2"}
        )
        assert status == 201, host
        assert host["control_address"] == "127.0.0.2" and host["files"] == "remote"
        assert host["accel"] == "tcg"
        _, local, _ = await r.call("GET", "/api/v2/admin/hosts/local")
        assert local["control_address"] == "127.0.0.1"
        status, _, _ = await r.call("POST", "/api/v2/admin/hosts/far/drain")
        assert status == 200
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        _, host, _ = await r.call("GET", "/api/v2/admin/hosts/far")
        assert host["control_address"] == "127.0.0.2" and host["labels"] == {"net": "far"}
        assert host["draining"] is True  # a drain outlives a restart
        fleet = next(c for c in r.server.components if isinstance(c, FleetComponent)).fleet
        spec = fleet.hosts["far"].spec
        assert (spec.accel, spec.files, spec.data_dir) == (
            "tcg",
            "remote",
            str(tmp_path / "far-data"),
        )


async def test_a_drained_host_takes_no_new_placements_until_undrained(
    fleet_server: Running, tmp_path: Any
) -> None:
    from tests.support.libvirt_testdriver import node_uri

    r = fleet_server
    status, _, _ = await r.call(
        "POST", "/api/v2/admin/hosts", json={"name": "second", "uri": node_uri(tmp_path, "s")}
    )
    assert status == 201
    op = await create(r, {"id": "before", "image": IMAGE, "host": "local", "wait_ready": False})
    assert op["state"] == "succeeded", op
    status, host, _ = await r.call("POST", "/api/v2/admin/hosts/local/drain")
    assert status == 200 and host["draining"] is True, host
    status, _, _ = await r.call("POST", "/api/v2/admin/hosts/nope/drain")
    assert status == 404
    for i in range(2):  # local is emptier than nothing only by its name: both go to second
        op = await create(r, {"id": f"new-{i}", "image": IMAGE, "wait_ready": False})
        assert op["state"] == "succeeded", op
        _, inst, _ = await r.call("GET", f"/api/v2/admin/instances/new-{i}")
        assert inst["host"] == "second"
    op = await create(r, {"id": "pinned", "image": IMAGE, "host": "local", "wait_ready": False})
    assert op["state"] == "failed" and "local: draining" in str(op), op
    _, inst, _ = await r.call("GET", "/api/v2/admin/instances/before")
    assert inst["state"] == "running" and inst["host"] == "local"  # what ran there still runs
    status, events, _ = await r.call("GET", "/api/v1/events?type=host.draining&limit=10")
    assert [e["host"] for e in events["items"]] == ["local"], events
    status, host, _ = await r.call("DELETE", "/api/v2/admin/hosts/local/drain")
    assert status == 200 and host["draining"] is False
    op = await create(r, {"id": "after", "image": IMAGE, "host": "local", "wait_ready": False})
    assert op["state"] == "succeeded", op


async def test_loadouts_and_images_are_listed(fleet_server: Running) -> None:
    r = fleet_server
    status, loadouts, _ = await r.call("GET", "/api/v2/admin/loadouts")
    names = {lo["name"] for lo in loadouts["items"]}
    assert {"minimal", "dev", "reviewer"} <= names
    status, reviewer, _ = await r.call("GET", "/api/v2/admin/loadouts/reviewer")
    assert any(s["id"] == "text-stats" and "input_schema" in s for s in reviewer["skills"])
    status, images, _ = await r.call("GET", "/api/v2/admin/images")
    assert [i["name"] for i in images["items"]] == [IMAGE]
    status, problem, _ = await r.call("POST", "/api/v2/admin/images", json={"recipe": "nope"})
    assert status == 422 and "unknown recipe" in problem["detail"]


async def test_metrics_show_instances_by_state_and_host(fleet_server: Running) -> None:
    r = fleet_server
    await create(r, {"id": "m-1", "image": IMAGE, "wait_ready": False})
    from agentic_sandbox.broker.observability.component import StoreGauges

    gauges = next(c for c in r.server.components if isinstance(c, StoreGauges))
    await gauges.refresh()
    _status, text, _ = await r.call("GET", "/metrics")
    assert b'sandbox_instances{host="local",state="running"} 1.0' in text
    assert b"sandbox_libvirt_call_duration_seconds_bucket" in text
    assert (
        b'sandbox_provision_stage_duration_seconds_count{outcome="ok",stage="booting"} 1.0' in text
    )


async def test_instance_quota_per_owner_is_429(tmp_path: Any) -> None:
    from agentic_sandbox.broker.instances import FleetComponent
    from agentic_sandbox.images import ImageStore
    from tests.support.fake_images import publish_fake
    from tests.support.inproc_server import make_settings, start_server
    from tests.support.libvirt_testdriver import node_uri

    publish_fake(ImageStore(tmp_path / "data" / "images"), IMAGE, recipe_name="fake")
    settings = make_settings(
        tmp_path,
        libvirt_uri=node_uri(tmp_path, "local"),
        kvm_probe=False,
        max_instances_per_owner=2,
    )
    async with start_server(settings, components=lambda svc: [FleetComponent(svc)]) as r:
        for i in range(2):
            op = await create(r, {"id": f"q-{i}", "image": IMAGE, "wait_ready": False})
            assert op["state"] == "succeeded"
        status, problem, resp = await r.call(
            "POST", "/api/v2/admin/instances", json={"id": "q-2", "image": IMAGE}
        )
        assert status == 429 and int(resp.headers["Retry-After"]) >= 1
        assert "limit 2" in problem["detail"]
        status, listing, _ = await r.call("GET", "/api/v2/admin/instances")
        assert [i["id"] for i in listing["items"]] == ["q-0", "q-1"]


async def test_a_delete_ends_the_incarnation_when_the_fleet_answers_late(
    fleet_server: Running, monkeypatch: Any
) -> None:
    """The fleet's `instance.deleted` event reaches the mirror while the delete is still
    finishing (here the fleet returns late, as on a loaded host): the incarnation ends all
    the same — once, as the caller's delete — instead of never."""
    r = fleet_server
    comp = next(c for c in r.server.components if isinstance(c, FleetComponent))
    ended: list[tuple[str, str, str]] = []

    async def record(e: Any) -> None:
        ended.append((e.instance_id, e.incarnation, e.actor))

    r.svc.incarnations.on_end("test", record)
    fleet_delete = comp.fleet.delete

    async def slow_delete(instance_id: str) -> None:
        await fleet_delete(instance_id)
        await asyncio.sleep(0.3)  # the mirror handles the fleet's event meanwhile

    monkeypatch.setattr(comp.fleet, "delete", slow_delete)
    assert (await create(r, {"id": "late-1", "image": IMAGE, "wait_ready": False}))[
        "state"
    ] == "succeeded"
    _, inst, _ = await r.call("GET", "/api/v2/admin/instances/late-1")
    status, _, _ = await r.call("DELETE", "/api/v2/admin/instances/late-1")
    assert status == 204
    assert ended == [("late-1", inst["incarnation"], "token:admin")]
    _, audit, _ = await r.call("GET", "/api/v2/admin/audit?subject_type=instance&subject_id=late-1")
    ends = [a["actor"] for a in audit["items"] if a["to_state"] == "deleted"]
    assert ends == ["token:admin"], audit["items"]


async def test_a_late_fleet_event_touches_neither_the_ended_instance_nor_its_successor(
    fleet_server: Running,
) -> None:
    """The mirror applies fleet events in order, behind the API: a state change of an instance's
    last moments can arrive after it was deleted (seen in CI: ``deleted`` then ``shutoff`` in
    the audit), or after its id was created again. Neither row changes."""
    from agentic_sandbox.fleet import FleetEvent, FleetEventKind, InstanceState

    r = fleet_server
    mirror = next(c for c in r.server.components if isinstance(c, FleetComponent)).mirror

    async def late_event(incarnation: str, detail: str) -> None:
        mirror.on_event(
            FleetEvent(
                kind=FleetEventKind.INSTANCE_STATE_CHANGED,
                host="local",
                instance_id="again",
                incarnation=incarnation,
                state=InstanceState.SHUTOFF,
                detail=detail,
            )
        )
        for _ in range(200):  # the mirror republishes each event once it has applied it
            _, page, _ = await r.call("GET", "/api/v1/events?instance_id=again&limit=200")
            if any((e["data"] or {}).get("detail") == detail for e in page["items"]):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the mirror did not handle {detail}")

    async def transitions() -> list[tuple[str | None, str]]:
        _, audit, _ = await r.call(
            "GET", "/api/v2/admin/audit?subject_type=instance&subject_id=again&limit=200"
        )
        return [(a["from_state"], a["to_state"]) for a in audit["items"] if a["to_state"]]

    assert (await create(r, {"id": "again", "image": IMAGE, "wait_ready": False}))[
        "state"
    ] == "succeeded"
    _, first, _ = await r.call("GET", "/api/v2/admin/instances/again")
    status, _, _ = await r.call("DELETE", "/api/v2/admin/instances/again")
    assert status == 204
    await late_event(first["incarnation"], "late stop of the first")
    assert (await transitions())[-1][1] == "deleted"
    status, _, _ = await r.call("GET", "/api/v2/admin/instances/again")
    assert status == 404

    assert (await create(r, {"id": "again", "image": IMAGE, "wait_ready": False}))[
        "state"
    ] == "succeeded"
    _, second, _ = await r.call("GET", "/api/v2/admin/instances/again")
    assert second["incarnation"] != first["incarnation"]
    before = await transitions()
    await late_event(first["incarnation"], "late stop of the first, again")
    _, now, _ = await r.call("GET", "/api/v2/admin/instances/again")
    assert now["state"] == "running", now
    assert await transitions() == before
