"""A failure at any step leaves nothing behind: no domain, file, volume, port or record."""

from __future__ import annotations

import pytest

from agentic_sandbox.fleet import (
    CloneSpec,
    FleetError,
    InstanceSpec,
    KernelBoot,
    NotFound,
    Resources,
)
from tests.support.fleet_env import Env


def spec(**kw: object) -> InstanceSpec:
    base: dict[str, object] = dict(
        instance_id="f1", image="img", resources=Resources(memory_mib=256)
    )
    return InstanceSpec.model_validate({**base, **kw})


def assert_clean(env: Env, iid: str = "f1") -> None:
    assert iid not in env.fleet.index
    assert [d for d in env.domains() if d != "sbx-gold"] == []
    assert env.instance_files() == []
    assert env.volumes() == []
    assert env.fleet.hosts["h1"].ports.in_use() == set()
    assert env.fleet.index.inflight == set()


@pytest.mark.parametrize(
    "stage", ["placing", "ports", "disk", "seed", "defining", "defined", "booting"]
)
async def test_create_fails_at_each_stage(env: Env, stage: str) -> None:
    seed = env.root / "seed.iso"
    seed.write_bytes(b"seed")
    env.faults.fail_at = {stage}
    with pytest.raises(FleetError) as ei:
        await env.fleet.create(spec(seed=str(seed)))
    assert ei.value.stage == {"defined": "defining"}.get(stage, stage)
    assert_clean(env)
    # and the same request then works
    env.faults.fail_at = set()
    await env.fleet.create(spec(seed=str(seed)))
    await env.fleet.delete("f1")
    assert_clean(env)


async def test_missing_image_and_kernel_are_reported_and_leave_nothing(env: Env) -> None:
    with pytest.raises(NotFound) as ei:
        await env.fleet.create(spec(image="nope"))
    assert ei.value.stage == "disk" and "nope" in str(ei.value)
    assert_clean(env)
    with pytest.raises(NotFound):
        await env.fleet.create(spec(boot=KernelBoot(kernel="no-kernel")))
    assert_clean(env)


@pytest.mark.parametrize("stage", ["disk", "restoring", "restore"])
async def test_clone_fails_at_each_stage(env: Env, stage: str) -> None:
    await env.fleet.create(spec().model_copy(update={"instance_id": "gold"}))
    await env.fleet.capture_state("gold", "g1")
    env.faults.fail_at = {stage}
    with pytest.raises(FleetError) as ei:
        await env.fleet.clone_from_state("g1", CloneSpec(instance_id="f1"))
    assert ei.value.stage in (stage, "restoring")
    assert "f1" not in env.fleet.index
    assert env.domains() == ["sbx-gold"]
    assert [n for n in env.instance_files() if not n.startswith("sbx-gold")] == []
    assert env.fleet.hosts["h1"].ports.in_use() == {env.fleet.index["gold"].record.ssh_port}
    env.faults.fail_at = set()
    clone = await env.fleet.clone_from_state("g1", CloneSpec(instance_id="f1"))
    assert clone.state.value == "running"


async def test_delete_failure_keeps_the_record(env: Env) -> None:
    await env.fleet.create(spec())
    env.faults.fail_at = {"delete"}
    with pytest.raises(RuntimeError):
        await env.fleet.delete("f1")
    assert "f1" in env.fleet.index and not env.fleet.index["f1"].deleting
    env.faults.fail_at = set()
    await env.fleet.delete("f1")
    assert_clean(env)
