"""sandboxctl against a server with a fleet (libvirt's test driver): `instance create` on a
server that has no image yet builds it first, a failed create names its stage and cause on
stderr and exits non-zero, and operations render with readable sub-tables.

Image builds are the one fake here: the server's builder publishes a small fake image at once
instead of running debootstrap (real builds are the e2e tier's); everything else — the CLI
process, the HTTP API, the operations, the fleet on libvirt's test driver — is real.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentic_sandbox.broker.instances import FleetComponent
from agentic_sandbox.images import BuiltImage, ImageBuilder
from tests.fleet_support.testdriver import node_uri
from tests.inproc import Running, make_settings, start_server
from tests.unit.images.images_fakes import publish_fake

RECIPE = "debian-12-agent"  # the server's default recipe


class InstantBuilder(ImageBuilder):
    """Builds a recipe by publishing a fake image under the recipe's real image name."""

    async def build_async(self, recipe: Any, *, progress: Any = None) -> BuiltImage:
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
        yield r


async def ctl(r: Running, *args: str, token: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update({"SANDBOX_URL": r.url, "SANDBOX_TOKEN": token or r.admin_token})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentic_sandbox.sandboxctl.main",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_create_without_an_image_builds_it_first(fleet_server: Running) -> None:
    r = fleet_server
    operator = await r.make_token("ops", "operator")
    code, out, err = await ctl(r, "instance", "create", "vm-0", "--no-wait", token=operator)
    assert code == 4, (out, err)  # an operator may create, only an admin may build
    assert f"ask an admin to run `sandboxctl image build {RECIPE}`" in err, err
    code, out, err = await ctl(r, "instance", "create", "vm-0", "--no-build")
    assert code == 6 and f"`sandboxctl image build {RECIPE}`" in err, (out, err)

    code, out, err = await ctl(r, "instance", "create", "vm-1", "--loadout", "minimal")
    assert code == 0, (out, err)
    assert f"image {RECIPE} is not built yet: building it first" in err, err
    assert f"image {RECIPE} is built" in err, err
    fields = dict(line.split(None, 1) for line in out.splitlines() if line[:1].strip())
    assert fields["kind"] == "provision" and fields["state"] == "succeeded", out
    status, inst, _ = await r.call("GET", "/api/v2/admin/instances/vm-1")
    assert status == 200 and inst["state"] == "running", inst


async def test_a_failed_create_names_stage_and_cause_and_renders_sub_tables(
    fleet_server: Running,
) -> None:
    r = fleet_server
    assert (await ctl(r, "image", "build", RECIPE))[0] == 0
    code, out, err = await ctl(r, "instance", "create", "vm-big", "--memory", "262144")
    assert code == 1, (out, err)
    assert "provision vm-big failed at stage placing: " in err, err
    assert "MiB" in err.splitlines()[-1], err  # the cause itself, not only the stage
    # the operation on stdout: its stages a table with a header, its error fields a table
    assert "name=" not in out and "at=" not in out, out
    lines = out.splitlines()
    (stages_at,) = [i for i, line in enumerate(lines) if line.startswith("stages")]
    assert lines[stages_at].split()[1:] == ["NAME", "AT", "SECONDS"], out
    assert any(line.split()[:1] == ["seed"] for line in lines[stages_at + 1 :]), out
    (error_at,) = [i for i, line in enumerate(lines) if line.startswith("error")]
    assert lines[error_at].split()[1:3] == ["stage", "placing"], out
    assert lines[error_at + 1].split()[:1] == ["cause"], out
    code, out, err = await ctl(
        r, "instance", "create", "vm-big", "--memory", "262144", "-o", "json"
    )
    assert code == 1 and '"stage": "placing"' in out, out
