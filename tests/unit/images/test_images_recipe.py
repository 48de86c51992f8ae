"""Recipe validation, hashing and the shipped recipe."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentic_sandbox.images import (
    BUILDER_VERSION,
    RecipeError,
    list_recipes,
    load_recipe,
    parse_recipe,
)
from agentic_sandbox.images.recipe import RECIPES_DIR


def shipped() -> dict[str, Any]:
    data = yaml.safe_load((RECIPES_DIR / "debian-12-agent.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_shipped_recipe_is_valid_and_complete() -> None:
    assert "debian-12-agent" in list_recipes()
    r = load_recipe("debian-12-agent")
    assert r.suite == "bookworm"
    assert r.variant == "minbase"
    for pkg in (
        "systemd",
        "systemd-sysv",
        "udev",
        "dbus",
        "cloud-init",
        "python3-cffi-backend",
        "openssh-server",
        "python3",
        "python3-venv",
        "sudo",
        "iproute2",
        "ca-certificates",
    ):
        assert pkg in r.packages, pkg
    assert r.kernel_package in r.all_packages()
    names = {req.split("==")[0] for req in r.runtime.requirements}
    assert {"grpcio", "protobuf", "ptyprocess"} <= names
    assert all("==" in req for req in r.runtime.requirements)
    assert r.runtime.venv_path == "/opt/agentic-sandbox/venv"
    assert r.customize.cloud_init["datasource_list"] == ["NoCloud", "None"]
    assert "apt-daily.timer" in r.customize.mask_units
    assert r.kernel_cmdline().startswith("root=LABEL=agentic-root ro ")
    assert "console=ttyS0" in r.kernel_cmdline()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("suite"), "suite"),
        (lambda d: d.update(variant="tiny"), "variant"),
        (lambda d: d["packages"].append("Bad Name"), "packages."),
        (lambda d: d["runtime"]["requirements"].append("grpcio>=1"), "runtime.requirements."),
        (lambda d: d["runtime"].update(venv_path="opt/venv"), "runtime.venv_path"),
        (lambda d: d["runtime"].update(venv_path="/opt/../etc"), "runtime.venv_path"),
        (lambda d: d["customize"].update(colour="blue"), "customize.colour"),
        (lambda d: d["customize"]["mask_units"].append("not a unit"), "customize.mask_units."),
        (
            lambda d: d["customize"]["cloud_init"].update(datasource_list=["Ec2"]),
            "customize.cloud_init",
        ),
        (lambda d: d["disk"].update(root_label="a-label-longer-than-16"), "disk.root_label"),
        (lambda d: d["disk"].update(free_space_mib=-1), "disk.free_space_mib"),
        (lambda d: d.update(mirror="ftp://example.invalid/debian"), "mirror"),
        (lambda d: d.update(mirror="http://x/ --foo"), "mirror"),
        (lambda d: d["disk"].update(kernel_args=["init=/bin/sh; rm"]), "disk.kernel_args.0"),
    ],
)
def test_bad_recipe_names_the_field(mutate: Any, field: str) -> None:
    data = shipped()
    mutate(data)
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data, "test.yaml")
    text = str(exc.value)
    assert "invalid recipe test.yaml" in text
    assert f"  {field}" in text, text


def test_duplicate_requirement_is_rejected() -> None:
    data = shipped()
    data["runtime"]["requirements"].append("GrpcIO==1.0.0")
    with pytest.raises(RecipeError, match="requirement listed twice: grpcio"):
        parse_recipe(data)


def test_required_packages_enforced() -> None:
    data = shipped()
    data["packages"].remove("cloud-init")
    with pytest.raises(RecipeError, match="packages must include cloud-init"):
        parse_recipe(data)


def test_yaml_errors_and_unknown_names(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    with pytest.raises(RecipeError, match="invalid recipe name"):
        load_recipe("Bad Name!")
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(shipped()))
    with pytest.raises(RecipeError, match="name: must be 'other'"):
        load_recipe("other", recipes_dir=tmp_path)
    with pytest.raises(RecipeError, match="top level must be a mapping"):
        parse_recipe(["a"])


def test_hash_is_stable() -> None:
    a = load_recipe("debian-12-agent")
    b = parse_recipe(shipped())
    assert a.content_hash() == b.content_hash()
    assert len(a.content_hash()) == 64
    assert a.image_name() == f"debian-12-agent-{a.content_hash()[:12]}"
    # Independent of list order and duplicates where order does not matter.
    data = shipped()
    data["packages"] = [*reversed(data["packages"]), data["packages"][0]]
    data["runtime"]["requirements"].reverse()
    data["customize"]["mask_units"].reverse()
    assert parse_recipe(data).content_hash() == a.content_hash()
    # The description is documentation, not content.
    data["description"] = "something else"
    assert parse_recipe(data).content_hash() == a.content_hash()
    assert a.hash_input()["builder_version"] == BUILDER_VERSION


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["packages"].append("git"),
        lambda d: d["runtime"]["requirements"].__setitem__(0, "grpcio==1.85.0"),
        lambda d: d.update(mirror="http://mirror.example.invalid/debian"),
        lambda d: d["customize"]["mask_units"].append("logrotate.timer"),
        lambda d: d["customize"].update(hostname="other"),
        lambda d: d["customize"]["files"].append({"path": "/etc/motd", "content": "hi"}),
        lambda d: d["disk"].update(compression="none"),
        lambda d: d["disk"].update(free_space_mib=512),
        lambda d: d.update(kernel_package="linux-image-amd64"),
    ],
)
def test_hash_is_sensitive(mutate: Any) -> None:
    base = shipped()
    base["customize"].setdefault("files", [])
    data = copy.deepcopy(base)
    mutate(data)
    assert parse_recipe(data).content_hash() != parse_recipe(base).content_hash()


def test_hash_covers_builder_version_and_code(monkeypatch: pytest.MonkeyPatch) -> None:
    import agentic_sandbox.images.recipe as recipe_mod

    r = load_recipe("debian-12-agent")
    before = r.content_hash()
    assert r.hash_input()["builder_code"] == recipe_mod.builder_code_digest()
    monkeypatch.setattr(recipe_mod, "BUILDER_VERSION", BUILDER_VERSION + "-next")
    assert r.content_hash() != before
    monkeypatch.setattr(recipe_mod, "BUILDER_VERSION", BUILDER_VERSION)
    assert r.content_hash() == before
    monkeypatch.setattr(recipe_mod, "builder_code_digest", lambda: "edited-builder")
    assert r.content_hash() != before


def test_recipe_is_frozen() -> None:
    r = load_recipe("debian-12-agent")
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError
        r.suite = "trixie"  # type: ignore[misc]
