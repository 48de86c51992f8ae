"""Several hosts: placement spreads, labels steer, unreachable hosts are kept and retried."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentic_sandbox.fleet import (
    CloneSpec,
    Conflict,
    FleetError,
    HostSpec,
    HostUnavailable,
    InstanceSpec,
    InstanceState,
    NoCapacity,
    Resources,
)
from agentic_sandbox.fleet.domain_config import CloneIdentity, DomainConfig
from agentic_sandbox.fleet.libvirt.domain_xml import domain_facts, netdev_value
from tests.support.fleet_env import Env
from tests.support.libvirt_testdriver import node_uri


async def test_placement_spreads_and_follows_labels(env: Env) -> None:
    f = env.fleet
    await f.add_host(
        HostSpec(
            name="h2",
            uri=node_uri(env.root, "h2"),
            labels={"zone": "b"},
            data_dir=str(env.root / "h2"),
        )
    )
    img = env.root / "img.qcow2"
    await f.import_image("img", str(img), host="h2")
    for i in range(4):
        await f.create(
            InstanceSpec(instance_id=f"i{i}", image="img", resources=Resources(memory_mib=512))
        )
    hosts = sorted(i.host for i in await f.list_instances())
    assert hosts == ["h1", "h1", "h2", "h2"]
    z = await f.create(InstanceSpec(instance_id="zb", image="img", host_labels={"zone": "b"}))
    assert z.host == "h2"
    with pytest.raises(NoCapacity):
        await f.create(InstanceSpec(instance_id="zc", image="img", host_labels={"zone": "c"}))
    assert "zc" not in f.index
    info = {h.spec.name: h for h in await f.list_hosts()}
    assert info["h2"].instances == 3 and info["h2"].committed_memory_mib == 2 * 512 + 512
    with pytest.raises(Conflict):
        await f.remove_host("h2")


async def test_anti_affinity_spreads_a_group(env: Env) -> None:
    f = env.fleet
    await f.add_host(
        HostSpec(
            name="h2", uri=node_uri(env.root, "h2", memory_mib=4096), data_dir=str(env.root / "h2")
        )
    )
    await f.import_image("img", str(env.root / "img.qcow2"), host="h2")
    a = await f.create(InstanceSpec(instance_id="w1", image="img", anti_affinity="web"))
    b = await f.create(InstanceSpec(instance_id="w2", image="img", anti_affinity="web"))
    assert a.host != b.host


async def test_unreachable_host_is_kept_and_not_placed_on(env: Env) -> None:
    f = env.fleet
    info = await f.add_host(HostSpec(name="down", uri="qemu+unix:///system?socket=/nonexistent"))
    assert not info.reachable and info.reason
    assert "host.unreachable" in env.kinds()
    with pytest.raises(NoCapacity):
        await f.create(InstanceSpec(instance_id="x", image="img", host="down"))
    i = await f.create(InstanceSpec(instance_id="y", image="img"))
    assert i.host == "h1" and i.state is InstanceState.RUNNING
    await f.remove_host("down")
    assert [h.spec.name for h in await f.list_hosts()] == ["h1"]


async def test_an_image_import_for_any_host_skips_an_unreachable_one(env: Env) -> None:
    """A create that does not name a host imports its image into every host first: one cut
    off must not fail it (placement skips that host anyway); naming it says it is unreachable."""
    f = env.fleet
    await f.add_host(HostSpec(name="down", uri="qemu+unix:///system?socket=/nonexistent"))
    out = await f.import_image("img4", str(env.root / "img.qcow2"))
    assert list(out) == ["h1"]
    with pytest.raises(HostUnavailable, match="host down is unreachable"):
        await f.import_image("img4", str(env.root / "img.qcow2"), host="down")
    await f.remove_host("down")


async def test_a_create_brings_its_image_to_the_host_it_is_placed_on_only(env: Env) -> None:
    """Images reach a host on first placement (a host added after the image was built, or cut
    off then, has none): the chosen host gets it, verified; the others are not sent it."""
    f = env.fleet
    await f.add_host(
        HostSpec(name="h2", uri=node_uri(env.root, "h2"), data_dir=str(env.root / "h2"))
    )
    img = str(env.root / "img.qcow2")
    uploads = len([k for k in env.kinds() if k == "image.uploading"])
    i = await f.create(
        InstanceSpec(instance_id="p1", image="img6", image_files={"img6": img}, host="h2")
    )
    assert i.host == "h2" and i.state is InstanceState.RUNNING
    h2 = f.hosts["h2"].volumes
    assert await h2.verified_digest("bases", "img6") is not None
    assert not await f.hosts["h1"].volumes.exists(f.hosts["h1"].volumes.path("bases", "img6"))
    # a second create on that host finds it there: no second upload
    await f.create(
        InstanceSpec(instance_id="p2", image="img6", image_files={"img6": img}, host="h2")
    )
    assert len([k for k in env.kinds() if k == "image.uploading"]) == uploads + 1


async def test_add_host_is_idempotent(env: Env) -> None:
    spec = env.fleet.hosts["h1"].spec
    assert (await env.fleet.add_host(spec)).reachable
    with pytest.raises(Conflict):
        await env.fleet.add_host(spec.model_copy(update={"labels": {"x": "y"}}))


def _record_forwards(env: Env, host: str) -> dict[str, str]:
    """The guest forward the fleet gives each of ``host``'s domains, by name: from the
    definitions of creates, from the identities of captures and clones (libvirt's test driver
    keeps no `<qemu:commandline>`, so they are read where the fleet makes them)."""
    h = env.fleet.hosts[host]
    seen: dict[str, str] = {}
    render, reidentify = h.render, h.reidentify

    def rendered(cfg: DomainConfig) -> str:
        xml = render(cfg)
        seen[cfg.name] = _guest_forward(xml)
        return xml

    def reidentified(definition: str, ident: CloneIdentity) -> str:
        seen[ident.name] = _forward_of(netdev_value(ident.net))
        return reidentify(definition, ident)

    h.render = rendered  # type: ignore[method-assign]
    h.reidentify = reidentified  # type: ignore[method-assign]
    return seen


def _guest_forward(definition: str) -> str:
    netdev = domain_facts(definition).netdev
    assert netdev is not None
    return _forward_of(netdev)


def _forward_of(netdev: str) -> str:
    return next(p for p in netdev.split(",") if p.startswith("guestfwd="))


async def test_guests_on_a_host_reach_the_control_plane_at_its_control_address(
    env: Env,
) -> None:
    """A create, a state capture and a clone from it on a host with `control_address` all
    lead the guest's forward there; the other host's guests keep the fleet's address."""
    f = env.fleet
    await f.add_host(
        HostSpec(
            name="h2",
            uri=node_uri(env.root, "h2"),
            labels={"net": "far"},
            data_dir=str(env.root / "h2"),
            control_address="198.18.7.1",
        )
    )
    await f.import_image("img", str(env.root / "img.qcow2"), host="h2")
    on_h1, on_h2 = _record_forwards(env, "h1"), _record_forwards(env, "h2")
    far = await f.create(
        InstanceSpec(instance_id="far", image="img", agent_port=8124, host_labels={"net": "far"})
    )
    near = await f.create(InstanceSpec(instance_id="near", image="img", host="h1"))
    assert far.host == "h2" and near.host == "h1"
    forward = "guestfwd=tcp:10.0.2.2:8124-tcp:198.18.7.1:8124"
    assert on_h2["sbx-far"] == forward
    assert on_h1["sbx-near"] == "guestfwd=tcp:10.0.2.2:8120-tcp:127.0.0.1:8120"
    on_h2.clear()
    await f.capture_state("far", "far-v1")
    assert on_h2["sbx-far"] == forward  # the frozen definition
    clone = await f.clone_from_state("far-v1", CloneSpec(instance_id="far-c", agent_port=8124))
    assert clone.host == "h2"
    assert on_h2["sbx-far-c"] == forward


def test_a_control_address_is_an_ip_literal() -> None:
    assert (
        HostSpec(name="h", uri="test:///default", control_address="fd00::0:1").control_address
        == "fd00::1"
    )
    for bad in ("example.org", "0.0.0.0", "::", "224.0.0.1", "10.0.0.1:80", "1.2.3.4 "):
        with pytest.raises(ValidationError, match="control_address"):
            HostSpec(name="h", uri="test:///default", control_address=bad)


async def test_an_image_reaches_a_host_once_verified_by_sha256(env: Env) -> None:
    import asyncio
    import hashlib

    f = env.fleet
    await f.add_host(
        HostSpec(name="h2", uri=node_uri(env.root, "h2"), data_dir=str(env.root / "h2"))
    )
    src = env.root / "img2.qcow2"
    src.write_bytes(b"image-two" * 1000)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = await asyncio.gather(*(f.import_image("img2", str(src), host="h2") for _ in range(3)))
    assert {o["h2"] for o in out} == {str(env.root / "h2" / "bases" / "img2")}

    def uploads() -> list[str | None]:
        return [
            e.host for e in env.events if e.kind.value == "image.uploading" and e.detail == "img2"
        ]

    assert uploads() == ["h2"]  # once, to the host asked for only
    assert (env.root / "h2" / "bases" / "img2.sha256").read_text().strip() == digest
    assert not (env.data / "bases" / "img2").exists()
    await f.import_image("img2", str(src), host="h2")
    assert uploads() == ["h2"]

    # a base from before verification (no marker): read back once, and marked when right
    marker = env.root / "h2" / "bases" / "img2.sha256"
    marker.unlink()
    await f.import_image("img2", str(src), host="h2")
    assert uploads() == ["h2"] and marker.read_text().strip() == digest
    # ... and put again when it is not what it should be
    marker.unlink()
    (env.root / "h2" / "bases" / "img2").write_bytes(b"truncated")
    await f.import_image("img2", str(src), host="h2")
    assert (env.root / "h2" / "bases" / "img2").read_bytes() == src.read_bytes()
    assert uploads() == ["h2", "h2"]


async def test_a_copy_that_reads_back_wrong_is_removed_naming_both_digests(env: Env) -> None:
    import hashlib

    f = env.fleet
    storage = f.hosts["h1"].storage
    assert storage is not None
    src = env.root / "img3.qcow2"
    src.write_bytes(b"image-three" * 1000)
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    storage.digest = lambda path: "0" * 64  # type: ignore[method-assign]  # the readback differs
    with pytest.raises(FleetError) as err:
        await f.import_image("img3", str(src), host="h1")
    assert want in str(err.value) and "0" * 64 in str(err.value)
    assert not (env.data / "bases" / "img3").exists()
    assert not (env.data / "bases" / "img3.sha256").exists()
