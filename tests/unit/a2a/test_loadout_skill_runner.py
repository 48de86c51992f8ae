"""A loadout's skills reach the task layer as written: a skill's `runner` (the loadout schema's
name for its argv template) is the argv of that skill's runs."""

from __future__ import annotations

from agentic_sandbox.broker.tasks.skills import load_profile, plan_run
from agentic_sandbox.provision import load_catalog


def test_a_shipped_loadouts_skill_runner_is_the_runs_argv() -> None:
    reviewer = load_catalog().resolve("reviewer")
    spec = reviewer.model_dump(mode="json")
    written = {s["id"]: s["runner"] for s in spec["skills"] if s.get("runner")}
    assert written, "the reviewer loadout declares a skill with its own runner"
    profile = load_profile({}, spec)
    assert not profile.problems, profile.problems
    for skill_id, runner in written.items():
        (skill,) = [s for s in profile.skills if s.id == skill_id]
        plan = plan_run(
            profile,
            skill,
            text="hello world",
            data={"text": "hello world"},
            has_data=True,
            task_id="t1",
            context_id="c1",
        )
        assert plan.argv[: len(runner) - 1] == runner[:-1], (skill_id, plan.argv)


def test_a_registered_skill_may_still_say_command() -> None:
    profile = load_profile(
        {"skills": [{"id": "lint", "name": "Lint", "description": "d", "command": ["true"]}]}, None
    )
    (lint,) = [s for s in profile.skills if s.id == "lint"]
    assert lint.runner == ["true"]
