"""sandboxctl against a server with a fleet (libvirt's test driver): `instance create` on a
server that has no image yet builds it first, a failed create names its stage and cause on
stderr and exits non-zero, and operations (failed and finished), instances and hosts render
nested values as readable sub-tables.

Two fakes: the server's image builder publishes a small fake image at once instead of running
debootstrap (real builds are the e2e tier's), and a warm pool's golden VM "prints" cloud-init's
marker on its console; everything else — the CLI process, the HTTP API, the operations, the
fleet on libvirt's test driver — is real. (The global-options test runs most verbs' `main()`
in this process, the same argv and environment as a `sandboxctl` process; two stay processes.)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox import AsyncClient
from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.images import BuiltImage, ImageBuilder
from agentic_sandbox.provision.egress_rules import EgressConfig
from tests.integration.cli.test_sandboxctl_verbs import (
    NON_FLEET_VERBS,
    Case,
    all_verbs,
    run_both_ways,
)
from tests.support.cli import Sandboxctl
from tests.support.fake_images import publish_fake
from tests.support.inproc_server import Running, make_settings, start_server
from tests.support.libvirt_testdriver import golden_console_says_done, node_uri
from tests.support.server import free_port

RECIPE = "debian-12-agent"  # the server's default recipe
# set-context and use-context change the CLI's own file: test_sandboxctl.py covers them
CONFIG_VERBS = {"config set-context", "config use-context"}


class InstantBuilder(ImageBuilder):
    """Builds a recipe by publishing a fake image under the recipe's real image name."""

    async def build_async(self, recipe: Any, *, progress: Any = None) -> BuiltImage:
        hit = self.cached(recipe)
        if hit is not None:  # as the real builder: a cached build is reused at once
            return hit
        name = self.image_name(recipe)
        for stage in ("prepare", "rootfs", "disk"):
            await asyncio.sleep(0.2)
            if progress is not None:
                progress(type("P", (), {"stage": stage})())
        publish_fake(self.store, name, recipe_name=str(recipe))
        image = self.cached(recipe)
        assert image is not None
        return image


@pytest.fixture
async def fleet_server(tmp_path: Path) -> AsyncIterator[Running]:
    settings = make_settings(tmp_path, libvirt_uri=node_uri(tmp_path, "local"), kvm_probe=False)

    def components(svc: Any) -> list[Any]:
        comp = FleetComponent(svc)
        comp.images.builder = InstantBuilder(comp.images_dir)
        return [comp]

    async with start_server(settings, components=components) as r:
        golden_console_says_done(
            next(c for c in r.server.components if isinstance(c, FleetComponent))
        )
        yield r


@pytest.fixture
def cli(fleet_server: Running, tmp_path: Path) -> Sandboxctl:
    return Sandboxctl(fleet_server.url, fleet_server.admin_token, tmp_path / "cli")


async def test_create_without_an_image_builds_it_first(
    fleet_server: Running, cli: Sandboxctl
) -> None:
    r = fleet_server
    operator = await r.make_token("ops", "operator")
    code, out, err = await cli.run_async("instance", "create", "vm-0", "--no-wait", token=operator)
    assert code == 4, (out, err)  # an operator may create, only an admin may build
    assert f"ask an admin to run `sandboxctl image build {RECIPE}`" in err, err
    code, out, err = await cli.run_async("instance", "create", "vm-0", "--no-build")
    assert code == 6 and f"`sandboxctl image build {RECIPE}`" in err, (out, err)

    code, out, err = await cli.run_async("instance", "create", "vm-1", "--loadout", "minimal")
    assert code == 0, (out, err)
    assert f"image {RECIPE} is not built yet: building it first" in err, err
    assert f"image {RECIPE} is built" in err, err
    fields = dict(line.split(None, 1) for line in out.splitlines() if line[:1].strip())
    assert fields["kind"] == "provision" and fields["state"] == "succeeded", out
    status, inst, _ = await r.call("GET", "/api/v2/admin/instances/vm-1")
    assert status == 200 and inst["state"] == "running", inst


async def test_a_failed_create_names_stage_and_cause_and_renders_sub_tables(
    cli: Sandboxctl,
) -> None:
    assert (await cli.run_async("image", "build", RECIPE))[0] == 0
    code, out, err = await cli.run_async("instance", "create", "vm-big", "--memory", "262144")
    assert code == 1, (out, err)
    assert "provision vm-big failed at stage placing: " in err, err
    assert "MiB" in err.splitlines()[-1], err  # the cause itself, not only the stage
    # the operation on stdout: its stages a table with a header, its error fields a table
    assert "name=" not in out and "at=" not in out, out
    lines = out.splitlines()
    (stages_at,) = [i for i, line in enumerate(lines) if line.startswith("stages")]
    # (a stage's own facts, e.g. an upload's bytes, are further columns)
    assert lines[stages_at].split()[1:4] == ["NAME", "AT", "SECONDS"], out
    assert any(line.split()[:1] == ["seed"] for line in lines[stages_at + 1 :]), out
    (error_at,) = [i for i, line in enumerate(lines) if line.startswith("error")]
    assert lines[error_at].split()[1:3] == ["stage", "placing"], out
    assert lines[error_at + 1].split()[:1] == ["cause"], out
    code, out, err = await cli.run_async(
        "instance", "create", "vm-big", "--memory", "262144", "-o", "json"
    )
    assert code == 1 and '"stage": "placing"' in out, out


async def built(c: AsyncClient) -> None:
    await c.operations.wait(await c.images.build(RECIPE))


async def vm(c: AsyncClient, instance_id: str) -> str:
    """A small VM (the test driver's node is small), not waiting for an agent."""
    op = await c.instances.create(instance_id, memory_mib=256, disk_gib=2, wait_ready=False)
    await c.operations.wait(op)
    return instance_id


async def test_snapshots_revert_clone_and_operations(
    fleet_server: Running, cli: Sandboxctl
) -> None:
    r = fleet_server
    async with AsyncClient(r.url, r.admin_token) as c:
        await built(c)
        await vm(c, "snap-src")
    code, out, err = await cli.run_async("instance", "snapshot", "snap-src", "s1", "--memory")
    assert code == 0, (out, err)
    code, out, err = await cli.run_async("instance", "snapshots", "snap-src")
    assert code == 0 and out.splitlines()[0].split() == ["NAME", "KIND", "STATE", "CREATED", "AT"]
    assert out.splitlines()[1].split()[:2] == ["s1", "memory"], out
    code, out, err = await cli.run_async("instance", "revert", "snap-src", "s1", "-o", "json")
    assert code == 0 and json.loads(out)["state"] == "running", (out, err)
    code, out, err = await cli.run_async("instance", "revert", "snap-src", "nope")
    assert code == 3, (out, err)
    # a clone without waiting gives its operation; operation get --wait follows it
    code, out, err = await cli.run_async(
        "instance", "clone", "snap-src", "snap-copy", "--snapshot", "s1", "--no-wait", "-o", "json"
    )
    assert code == 0, (out, err)
    op = json.loads(out)
    assert op["kind"] == "provision" and op["subject_id"] == "snap-copy", op
    code, out, err = await cli.run_async("operation", "get", op["id"], "--wait", "-o", "json")
    assert code == 0 and json.loads(out)["state"] == "succeeded", (out, err)
    code, out, err = await cli.run_async(
        "operation", "list", "--subject", "snap-copy", "-o", "json"
    )
    assert [o["id"] for o in json.loads(out)["items"]] == [op["id"]], out
    code, out, err = await cli.run_async("operation", "get", op["id"])  # a table, sub-tables
    assert code == 0 and "stages" in out and "name=" not in out, out
    code, out, err = await cli.run_async("operation", "get", "no-such-operation")
    assert code == 3, (out, err)


async def test_pool_create_list_delete(fleet_server: Running, cli: Sandboxctl) -> None:
    r = fleet_server
    async with AsyncClient(r.url, r.admin_token) as c:
        await built(c)
    code, out, err = await cli.run_async("pool", "create", "--size", "1", "-o", "json")
    assert code == 0, (out, err)
    op = json.loads(out)
    assert op["kind"] == "pool-prepare" and op["state"] == "succeeded", op
    key = op["subject_id"]
    deadline = time.monotonic() + 60
    while True:  # the fleet fills the pool after the operation
        code, out, err = await cli.run_async("pool", "list")
        assert code == 0 and out.splitlines()[0].split()[:3] == ["KEY", "IMAGE", "LOADOUT"], out
        row = next(line.split() for line in out.splitlines() if line.startswith(key))
        if row[5] == "1" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert row[2:6] == ["minimal@1", "isolated", "1", "1"], out  # size 1, one VM ready
    for flags, source in ((["--cold"], "image"), ([], "pool"), (["--from-pool"], "pool")):
        iid = f"p-{source}-{len(flags) and flags[0].strip('-')}"
        code, out, err = await cli.run_async(
            "instance", "create", iid, *flags, "--no-wait", "-o", "json"
        )
        assert code == 0, (flags, out, err)
        async with AsyncClient(r.url, r.admin_token) as c:
            done = await c.operations.wait(json.loads(out)["id"])
        assert done.result is not None and done.result["source"] == source, (flags, done)
    code, out, err = await cli.run_async("instance", "create", "x", "--cold", "--from-pool")
    assert code == 2 and "not allowed with argument" in err, (out, err)
    code, out, err = await cli.run_async("pool", "delete", key)
    assert code == 0 and out.strip() == f"deleted pool {key}", (out, err)
    code, out, err = await cli.run_async("pool", "list", "-o", "json")
    assert json.loads(out) == {"items": []}
    code, out, err = await cli.run_async("pool", "delete", key)
    assert code == 3, (out, err)


FLEET_VERBS = {
    "instance create",
    "instance start",
    "instance stop",
    "instance restart",
    "instance force-off",
    "instance suspend",
    "instance resume",
    "instance delete",
    "instance snapshot",
    "instance snapshots",
    "instance revert",
    "instance clone",
    "instance console",
    "instance ssh",
    "operation get",
    "operation cancel",
    "pool create",
    "pool list",
    "pool delete",
    "image build",
    "image list",
    "host add",
    "host list",
    "host drain",
    "host undrain",
    "host libvirtd-cert",
    "loadout list",
    "loadout show",
    "loadout apply",
    "loadout versions",
    "loadout activate",
}


async def test_fleet_verbs_work_with_global_options_in_any_position(
    fleet_server: Running, tmp_path: Path
) -> None:
    r = fleet_server
    names = itertools.count()
    ctl = Sandboxctl(f"http://127.0.0.1:{free_port()}", r.admin_token, tmp_path / "pos")
    async with AsyncClient(r.url, r.admin_token) as c:
        await built(c)
        src = await vm(c, "pos-src")
        await c.snapshots.create(src, "base", memory=True)
        (first_op,) = await c.operations.list(subject_id=src)

        def fresh_vm(then: str | None = None) -> Callable[[], Awaitable[list[str]]]:
            async def make() -> list[str]:
                iid = await vm(c, f"pos-{next(names)}")
                if then is not None:
                    await c.instances.action(iid, then)  # type: ignore[arg-type]
                return [iid]

            return make

        web_file = tmp_path / "pos-web.yaml"
        web_file.write_text("name: pos-web\nextends: minimal\ndescription: positions\n")

        drained = "pos-drained"  # a host of its own: draining "local" would stop the creates
        await c.hosts.add(drained, node_uri(tmp_path, drained))

        async def fresh_pool() -> list[str]:
            op = await c.operations.wait(await c.pools.create(size=1, network="nat"))
            return [op.subject_id]

        cases = [
            Case(
                "instance create",
                lambda: [f"pos-new-{next(names)}", "--memory", "256", "--disk", "2"],
                process=True,
            ),
            Case("instance start", fresh_vm("force-off")),
            Case("instance stop", fresh_vm()),
            Case("instance restart", fresh_vm()),
            Case("instance force-off", fresh_vm()),
            Case("instance suspend", fresh_vm()),
            Case("instance resume", fresh_vm("suspend")),
            Case("instance delete", fresh_vm(), False, lambda out: out.startswith("deleted ")),
            Case("instance snapshot", lambda: [src, f"snap-{next(names)}", "--memory"]),
            Case("instance snapshots", lambda: [src]),
            Case("instance revert", lambda: [src, "base"]),
            Case("instance clone", lambda: [src, f"pos-c{next(names)}", "--snapshot", "base"]),
            Case("instance console", lambda: [src], False),
            # (a process: it execs ssh; nothing listens)
            Case("instance ssh", lambda: [src, "true"], False, code=255, process=True),
            Case("operation get", lambda: [first_op.id]),
            Case("operation cancel", lambda: [first_op.id]),
            Case("pool create", lambda: ["--size", "1"]),
            Case("pool list", lambda: []),
            Case("pool delete", fresh_pool, False, lambda out: out.startswith("deleted pool ")),
            Case("image build", lambda: [RECIPE]),
            Case("image list", lambda: []),
            Case("host add", lambda: [f"h{next(names)}", node_uri(tmp_path, f"h{next(names)}")]),
            Case("host list", lambda: []),
            Case("host drain", lambda: [drained]),  # (again: still draining, the same answer)
            Case("host undrain", lambda: [drained]),
            # (writes its files and says so on stderr: stdout stays empty)
            Case(
                "host libvirtd-cert",
                lambda: ["198.18.0.1", "--out", str(tmp_path / f"pki-{next(names)}")],
                False,
                lambda out: out.strip() == "",
            ),
            Case("loadout list", lambda: []),
            Case("loadout show", lambda: ["minimal"]),
            Case("loadout apply", lambda: [str(web_file)]),
            Case("loadout versions", lambda: ["pos-web"]),
            Case("loadout activate", lambda: ["pos-web", "1"]),
        ]
        assert {case.verb for case in cases} == FLEET_VERBS
        assert all_verbs() - CONFIG_VERBS == FLEET_VERBS | NON_FLEET_VERBS
        for case in cases:
            await run_both_ways(ctl, r.url, case)
            for inst in await c.instances.list():  # the node is small: room for the next
                if inst.id != src:
                    await c.instances.delete(inst.id)


def sections(out: str) -> dict[str, list[list[str]]]:
    """A fields table by field: a field's words, then each continuation line's (a sub-table's
    rows are indented under its field)."""
    found: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            key, *rest = line.split()
            current = found.setdefault(key, [])
            current.append(rest)
        else:
            current.append(line.split())
    return found


def numbers(words: list[str]) -> list[float]:
    return [float(w) for w in words]


async def test_operation_get_and_nested_fields_render_as_sub_tables(
    fleet_server: Running, cli: Sandboxctl, tmp_path: Path
) -> None:
    """`operation get` of a failed and of a finished operation, an instance, and a host with
    labels (a nested object in a list's rows): sub-tables, the server's values, no repr."""
    r = fleet_server
    assert (await cli.run_async("image", "build", RECIPE))[0] == 0

    # ---- a failed operation: its stages with times, its error's stage and cause -------------
    code, out, err = await cli.run_async(
        "instance", "create", "vm-big", "--memory", "262144", "-o", "json"
    )
    assert code == 1, (out, err)
    failed = json.loads(out)
    code, out, err = await cli.run_async("operation", "get", failed["id"])
    assert code == 0, (out, err)
    assert not any(c in out for c in "{}[]'\"") and "=" not in out, out
    got = sections(out)
    assert got["state"] == [["failed"]] and got["stage"] == [["placing"]], out
    head, rule, *stage_rows = got["stages"]
    # (the uploading stage's facts — host, image, bytes — are further columns)
    assert head[:3] == ["NAME", "AT", "SECONDS"] and set("".join(rule)) == {"─"}, out
    assert [row[0] for row in stage_rows] == [s["name"] for s in failed["stages"]], out
    assert [numbers(row[1:3]) for row in stage_rows] == [
        [round(s["at"], 3), round(s["seconds"], 3)] for s in failed["stages"]
    ], out
    assert got["error"][0] == ["stage", "placing"], out
    assert got["error"][1] == ["cause", *failed["error"]["cause"].split()], out
    assert got["result"] == [["-"]], out

    # ---- a finished one: its result is a sub-table, with the result's stages inside -------
    code, out, err = await cli.run_async(
        "instance", "create", "vm-1", "--memory", "256", "--disk", "2", "-o", "json"
    )
    assert code == 0, (out, err)
    done = json.loads(out)
    code, out, err = await cli.run_async("operation", "get", done["id"])
    assert code == 0, (out, err)
    assert not any(c in out for c in "{}[]'\"") and "=" not in out, out
    got = sections(out)
    assert got["state"] == [["succeeded"]] and got["error"] == [["-"]], out
    names = [row[0] for row in got["stages"][2:]]
    assert names == [s["name"] for s in done["stages"]], out
    assert names[0] == "seed" and names[-1] == "ready", out
    result = got["result"]
    assert result[0] == ["instance_id", "vm-1"] and ["host", "local"] in result, out
    assert ["source", "image"] in result, out
    (nested_at,) = [i for i, row in enumerate(result) if row[:1] == ["stages"]]
    assert result[nested_at][1:4] == ["NAME", "AT", "SECONDS"], out
    assert [row[0] for row in result[nested_at + 2 :]] == names, out

    # ---- an instance: its fields, the server's values ---------------------------------------
    code, out, err = await cli.run_async("instance", "get", "vm-1")
    assert code == 0, (out, err)
    status, inst, _ = await r.call("GET", "/api/v2/admin/instances/vm-1")
    assert status == 200
    got = sections(out)
    assert set(got) == set(inst), out
    for key in ("id", "state", "host", "image", "loadout", "vcpus", "memory_mib", "disk_gib"):
        assert got[key] == [[str(inst[key])]], (key, out)

    # ---- a nested object in a list's rows: a host's labels ----------------------------------
    uri = node_uri(tmp_path, "labelled")
    code, out, err = await cli.run_async(
        "host", "add", "labelled", uri, "--label", "zone=a", "--label", "rack=r1"
    )
    assert code == 0, (out, err)
    assert sorted(sections(out)["labels"]) == [["rack", "r1"], ["zone", "a"]], out
    code, out, err = await cli.run_async("host", "list")
    assert code == 0, (out, err)
    lines = out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("labelled ")]
    labels_col = lines[0].index("LABELS")
    first, second = lines[at][labels_col:].split()[:2], lines[at + 1][labels_col:].split()[:2]
    assert {tuple(first), tuple(second)} == {("zone", "a"), ("rack", "r1")}, out
    assert not lines[at + 1][:labels_col].strip(), out  # the continuation is under LABELS
    assert "{" not in out and "'" not in out, out
    # where each host's guests reach the server, and what is committed of what it has
    header = lines[0]
    for col in ("CONTROL ADDRESS", "STATE", "COMMITTED VCPUS", "CPUS", "INSTANCES"):
        assert col in header, out

    def cell(col: str) -> str:
        return lines[at][header.index(col) :].split()[0]

    assert (cell("CONTROL ADDRESS"), cell("STATE")) == ("127.0.0.1", "reachable"), out
    code, out, err = await cli.run_async(
        "host", "add", "far", node_uri(tmp_path, "far"), "--control-address", "127.0.0.9"
    )
    assert code == 6 and "control_address" in err and "guest_link_addresses" in err, (out, err)


async def test_loadout_apply_versions_activate(
    fleet_server: Running, cli: Sandboxctl, tmp_path: Path
) -> None:
    """The versioned-loadout verbs against a real server: apply is idempotent, versions is a
    table (or JSON), activate is a compare-and-set (exit 5 on a stale expected version), and
    errors exit with the codes of the others (6 invalid, 3 not found, 4 not allowed)."""
    r = fleet_server
    web = tmp_path / "web.yaml"
    web.write_text("name: web\nextends: minimal\ndescription: web v1\nresources: {cpus: 1}\n")
    code, out, err = await cli.run_async("loadout", "apply", str(web))
    assert code == 0 and "loadout web: saved as version 1" in err, (out, err)
    header = out.splitlines()[0].split()
    assert header[:4] == ["VERSION", "ACTIVE", "DIGEST", "EXTENDS"], out
    assert "minimal@1" in out, out
    code, out, err = await cli.run_async("loadout", "apply", str(web), "-o", "json")
    assert code == 0 and "unchanged: identical content is version 1" in err, (out, err)
    first = json.loads(out)
    assert (first["version"], first["created"], first["active"]) == (1, False, True)

    web.write_text("name: web\nextends: minimal\ndescription: web v2\nresources: {cpus: 2}\n")
    code, out, err = await cli.run_async("-o", "yaml", "loadout", "apply", str(web))
    assert code == 0 and "saved as version 2" in err and "version: 2" in out, (out, err)

    code, out, err = await cli.run_async("loadout", "versions", "web")
    assert code == 0, (out, err)
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    assert [row[:2] for row in rows] == [["1", "yes"], ["2", "no"]], out
    assert rows[0][2] == first["digest"][:12], out

    code, out, err = await cli.run_async(
        "loadout", "activate", "web", "2", "--expected-version", "1", "-o", "json"
    )
    assert code == 0, (out, err)
    assert json.loads(out) == {"name": "web", "active_version": 2, "previous_version": 1}
    code, out, err = await cli.run_async(
        "loadout", "activate", "web", "1", "--expected-version", "1"
    )
    assert code == 5 and "is 2, not 1" in err, (out, err)  # stale: someone moved it
    code, out, err = await cli.run_async("loadout", "activate", "web", "1")  # expects the current
    assert code == 0, (out, err)
    code, out, err = await cli.run_async("loadout", "versions", "web", "-o", "json")
    assert json.loads(out)["active_version"] == 1
    code, out, err = await cli.run_async("loadout", "list")
    assert out.splitlines()[0].split()[:3] == ["NAME", "VERSION", "OWNER"], out
    assert next(line.split()[:3] for line in out.splitlines() if line.startswith("web ")) == [
        "web",
        "1",
        "admin",
    ], out

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nresources: {cpus: 0}\n")
    code, out, err = await cli.run_async("loadout", "apply", str(bad))
    assert code == 6 and "spec.resources.cpus" in err, (out, err)
    bad.write_text("name: [unclosed\n")
    code, out, err = await cli.run_async("loadout", "apply", str(bad))
    assert code == 6 and "not valid YAML" in err, (out, err)
    code, out, err = await cli.run_async("loadout", "apply", str(tmp_path / "missing.yaml"))
    assert code == 6 and "cannot read" in err, (out, err)
    code, out, err = await cli.run_async("loadout", "versions", "no-such")
    assert code == 3, (out, err)
    viewer = await r.make_token("vera", "viewer")
    code, out, err = await cli.run_async("loadout", "apply", str(web), token=viewer)
    assert code == 4, (out, err)


async def test_create_an_allowlist_instance_with_its_rules(
    fleet_server: Running, cli: Sandboxctl
) -> None:
    """`instance create --allow` (implying `--network allowlist`) and the SDK's `allow=` make an
    allowlist instance whose rules the egress API answers, normalised; a bad rule is refused
    naming the `--allow` it came from, and nothing is made."""
    r = fleet_server
    assert (await cli.run_async("image", "build", RECIPE))[0] == 0
    code, out, err = await cli.run_async(
        "instance", "create", "al-1", "--allow", "API.Example.com.:443", "--allow",
        "*.pypi.org:443", "--no-wait",
    )  # fmt: skip
    assert code == 0, (out, err)

    async def rules(iid: str) -> tuple[str, list[str]]:
        """The instance's network and allowlist as the server recorded them (this server
        runs the fleet alone; the egress API is tested with its component elsewhere)."""
        async with r.svc.db.session() as s:
            row = await s.get(m.Instance, iid)
            assert row is not None
            egress = EgressConfig.model_validate(row.spec["egress"])
            return row.network_policy, [rule.text for rule in egress.allow]

    assert await rules("al-1") == ("allowlist", ["api.example.com:443", "*.pypi.org:443"])
    async with AsyncClient(r.url, r.admin_token) as c:
        await c.operations.wait(
            await c.instances.create("al-2", allow=["deb.debian.org:80:GET"], wait_ready=False)
        )
    assert await rules("al-2") == ("allowlist", ["deb.debian.org:80:GET"])
    code, out, err = await cli.run_async(
        "instance", "create", "al-3", "--allow", "no-port-here", "--no-wait"
    )
    assert code == 6 and "--allow 'no-port-here' (body.egress.allow.0" in err, (out, err)
    code, out, err = await cli.run_async(
        "instance", "create", "al-3", "--network", "nat", "--allow", "x.org:443", "--no-wait"
    )
    assert code == 2 and "--allow is the allowlist of --network allowlist, not nat" in err, err
    status, _, _ = await r.call("GET", "/api/v2/admin/instances/al-3")
    assert status == 404


async def test_host_drain_says_what_happens_to_the_hosts_warm_pools(
    fleet_server: Running, cli: Sandboxctl, tmp_path: Path
) -> None:
    """`host drain` of the host a pool lives on: the pool moves (its operation named); with
    no other host to take it, it says the pool stays and why."""
    assert (await cli.run_async("image", "build", RECIPE))[0] == 0
    code, out, err = await cli.run_async("pool", "create", "--size", "1", "-o", "json")
    assert code == 0, (out, err)
    key = json.loads(out)["subject_id"]
    code, out, err = await cli.run_async("host", "drain", "local")
    assert code == 0, (out, err)
    assert f"warm pool {key}: stays on local: no other host can take it" in err, err
    assert (await cli.run_async("host", "undrain", "local"))[0] == 0
    uri = node_uri(tmp_path, "spare")
    assert (await cli.run_async("host", "add", "spare", uri))[0] == 0
    code, out, err = await cli.run_async("host", "drain", "local", "-o", "json")
    assert code == 0, (out, err)
    (move,) = json.loads(out)["pools"]
    assert move["state"] == "moving" and move["key"] == key, out
    assert f"warm pool {key}: moving to another host (operation {move['operation_id']})" in err
    deadline = time.monotonic() + 60
    while True:
        code, out, err = await cli.run_async("operation", "get", move["operation_id"], "-o", "json")
        assert code == 0 and json.loads(out)["kind"] == "pool-move", (out, err)
        if json.loads(out)["state"] != "running" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert json.loads(out)["state"] == "succeeded", out
    assert json.loads(out)["result"]["to"] == "spare", out
