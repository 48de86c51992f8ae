"""Input validation: ids, names, paths, resources."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentic_sandbox.fleet import (
    HostSpec,
    InstanceSpec,
    IoTune,
    KernelBoot,
    Resources,
    validate_instance_id,
)


@pytest.mark.parametrize("good", ["a", "dev-1", "0abc", "a" * 63])
def test_valid_instance_ids(good: str) -> None:
    assert validate_instance_id(good) == good


@pytest.mark.parametrize("bad", ["", "-a", "A", "a_b", "a" * 64, "a/b", "../x", "a b", "ä"])
def test_invalid_instance_ids(bad: str) -> None:
    with pytest.raises(ValueError):
        validate_instance_id(bad)
    with pytest.raises(ValidationError) as ei:
        InstanceSpec(instance_id=bad, image="img")
    assert "instance_id" in str(ei.value)


@pytest.mark.parametrize("seed", ["relative.iso", "/a/../b.iso", "/a,b.iso", "/a\nb"])
def test_paths_are_validated(seed: str) -> None:
    with pytest.raises(ValidationError) as ei:
        InstanceSpec(instance_id="a", image="img", seed=seed)
    assert "seed" in str(ei.value)


@pytest.mark.parametrize("image", ["../etc/passwd", "a/b", "", ".hidden"])
def test_image_names_are_validated(image: str) -> None:
    with pytest.raises(ValidationError):
        InstanceSpec(instance_id="a", image=image)


def test_unknown_fields_rejected() -> None:
    with pytest.raises(ValidationError) as ei:
        InstanceSpec(instance_id="a", image="img", colour="red")  # type: ignore[call-arg]
    assert "colour" in str(ei.value)


def test_resources_bounds() -> None:
    with pytest.raises(ValidationError):
        Resources(vcpus=0)
    with pytest.raises(ValidationError):
        Resources(memory_mib=1)
    with pytest.raises(ValidationError):
        IoTune(total_bytes_sec=1, read_bytes_sec=1)


def test_kernel_cmdline_rejects_control_chars() -> None:
    with pytest.raises(ValidationError):
        KernelBoot(kernel="k", cmdline="a\nb")


def test_host_spec() -> None:
    with pytest.raises(ValidationError):
        HostSpec(name="h", uri="qemu:///system x")
    with pytest.raises(ValidationError):
        HostSpec(name="h", uri="qemu:///system", ssh_port_range=(10, 5))
    assert HostSpec(name="h", uri="qemu:///system").files == "auto"
