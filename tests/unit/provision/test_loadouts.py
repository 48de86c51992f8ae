"""Loadouts: the shipped ones resolve; extends merges; bad files fail naming the field."""

from __future__ import annotations

import pytest

from agentic_sandbox.provision import LoadoutError, load_catalog
from agentic_sandbox.provision.loadouts import LoadoutCatalog


def test_shipped_loadouts_resolve() -> None:
    c = load_catalog()
    assert {"minimal", "dev", "reviewer"} <= set(c.names())
    dev = c.resolve("dev")
    assert dev.network == "nat" and "git" in dev.packages and "tmux" in dev.packages
    assert dev.task_runner.argv == ["bash", "-lc", "{text}"]  # inherited from minimal
    reviewer = c.resolve("reviewer")
    skill = reviewer.skill("text-stats")
    assert skill is not None and skill.input_schema is not None
    assert skill.input_schema["required"] == ["text"]


def test_extends_merges_lists_and_maps() -> None:
    c = LoadoutCatalog([])
    c.add(
        {
            "name": "base",
            "packages": ["git"],
            "environment": {"A": "1"},
            "resources": {"cpus": 2, "memory_mib": 2048},
        }
    )
    c.add(
        {
            "name": "child",
            "extends": "base",
            "packages": ["git", "jq"],
            "environment": {"B": "2"},
            "resources": {"cpus": 4},
        }
    )
    lo = c.resolve("child")
    assert lo.packages == ["git", "jq"]
    assert lo.environment == {"A": "1", "B": "2"}
    assert (lo.resources.cpus, lo.resources.memory_mib) == (4, 2048)
    assert lo.needs_network_at_boot


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"name": "x", "resources": {"cpus": 0}}, "resources.cpus"),
        ({"name": "x", "network": "open"}, "network"),
        ({"name": "x", "packages": ["rm -rf /"]}, "packages"),
        ({"name": "x", "bogus": 1}, "bogus"),
        ({"name": "x", "extends": "missing"}, "extends: unknown loadout 'missing'"),
        (
            {
                "name": "x",
                "skills": [
                    {"id": "s", "name": "S", "description": "d", "input_schema": {"type": "nope"}}
                ],
            },
            "JSON Schema",
        ),
        ({"name": "x", "task_runner": {"argv": ["run", "{oops}"]}}, "placeholder"),
        ({"name": "X"}, "name"),
        ({"name": "x", "write_files": [{"path": "/a/../b", "content": ""}]}, "write_files.0.path"),
    ],
)
def test_bad_loadouts_name_the_field(doc: dict, fragment: str) -> None:
    c = LoadoutCatalog([])
    with pytest.raises(LoadoutError, match=fragment.replace("(", r"\(")):
        c.add(doc, "test.yaml")
    assert "x" not in c.names()


def test_extends_cycle_is_refused() -> None:
    c = LoadoutCatalog([])
    c.add({"name": "a"})
    c.add({"name": "b", "extends": "a"})
    c._raw["a"] = ({"name": "a", "extends": "b"}, "a.yaml")
    with pytest.raises(LoadoutError, match="cycle"):
        c.resolve("a")


def test_an_unknown_loadout_is_named_with_the_known_ones() -> None:
    with pytest.raises(LoadoutError) as ei:
        load_catalog().resolve("nosuch")
    msg = str(ei.value)
    assert msg.startswith("unknown loadout 'nosuch' (known: ") and "minimal" in msg
    assert "extends" not in msg  # the user asked for it; no parent is involved


def test_yaml_errors_are_clear() -> None:
    with pytest.raises(LoadoutError, match="not valid YAML"):
        LoadoutCatalog([]).add_yaml("name: [unclosed", "bad.yaml")
