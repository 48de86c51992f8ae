"""`extend`: a loadout document over an already resolved parent (how a saved version's
`extends` is resolved against the parent's pinned version) — the same result as the
catalog's chain, and problems naming the child's field."""

from __future__ import annotations

import pytest

from agentic_sandbox.provision import LoadoutError, extend, load_catalog


@pytest.mark.parametrize("name", ["dev", "reviewer", "minimal"])
def test_extending_a_resolved_parent_equals_resolving_the_chain(name: str) -> None:
    catalog = load_catalog()
    raw = catalog.raw(name)
    parent = catalog.resolve(raw["extends"]) if "extends" in raw else None
    assert extend(parent, raw, name) == catalog.resolve(name)


def test_the_merge_rules_apply_over_the_parent() -> None:
    catalog = load_catalog()
    dev = catalog.resolve("dev")
    child = extend(
        dev,
        {
            "extends": "dev",
            "packages": ["git", "ripgrep"],
            "environment": {"EDITOR": "nano"},
            "resources": {"cpus": 4},
            "budgets": {"defaults": {"memory_mib": 512}},
        },
        "dev-plus",
    )
    assert child.name == "dev-plus"
    assert child.packages == [*dev.packages, "ripgrep"]  # appended, de-duplicated
    assert child.environment == {"EDITOR": "nano", "LANG": "C.UTF-8"}  # maps merge
    assert (child.resources.cpus, child.resources.memory_mib) == (4, dev.resources.memory_mib)
    assert child.budgets.defaults.memory_mib == 512
    assert child.budgets.defaults.timeout_seconds == 600  # the parent's, kept
    assert child.write_files == dev.write_files and child.sudo is True


@pytest.mark.parametrize(
    ("child", "field"),
    [
        ({"resources": {"cpus": 0}}, "resources.cpus"),
        ({"packages": "git"}, "packages"),  # a string is not spread into letters
        ({"environment": ["A=1"]}, "environment"),
        ({"unknown": True}, "unknown"),
        ({"skills": [{"id": "x"}]}, "skills.0.name"),
        (
            {"budgets": {"defaults": {"timeout_seconds": 100}, "maxima": {"timeout_seconds": 10}}},
            "budgets",
        ),
    ],
)
def test_a_problem_names_the_field(child: dict[str, object], field: str) -> None:
    with pytest.raises(LoadoutError) as err:
        extend(load_catalog().resolve("minimal"), child, "bad")
    assert err.value.field == field, err.value
