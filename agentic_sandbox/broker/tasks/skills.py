"""An instance's skills and task runner: what the AgentCard advertises and how a task runs.

Where they come from (the contract documented in docs/a2a.md):
- `instances.spec["skills"]` / `instances.spec["task_runner"]`, else the same keys of the
  instance's loadout (`loadouts.spec`), else the built-in `shell` skill only.
- A skill: `{id, name, description, tags?, examples?, input_schema?, command?}`. `input_schema`
  is a JSON Schema the message's `data` part must satisfy; `command` is an argv template that
  replaces the runner's.
- The task runner: an argv template (`["bash", "-lc", "{text}"]`, the default) or
  `{"argv": [...], "user": ..., "cwd": ..., "env": {...}}`.

Templates substitute whole placeholders inside argv elements only — `{text}`, `{data}` (the
data part as JSON), `{skill}`, `{task_id}`, `{context_id}` — never through a shell string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from jsonschema.validators import validator_for
from pydantic import ValidationError

from agentic_sandbox.broker.agent_profile import RunnerSpec, SkillSpec
from agentic_sandbox.broker.sessions import BudgetOut

SHELL_SKILL_ID = "shell"
_PLACEHOLDER = re.compile(r"\{(text|data|skill|task_id|context_id)\}")
MAX_ENV_TEXT = 32 * 1024


SHELL_SKILL = SkillSpec(
    id=SHELL_SKILL_ID,
    name="Run a shell command",
    description="Runs the message text as a bash command line in a PTY session on this "
    "instance; the terminal output is the task's artifact and the exit code decides "
    "completed or failed. Prompts that wait for a person turn the task to input-required.",
    tags=["shell", "terminal"],
    examples=["uname -a", "make test"],
)


@dataclass(frozen=True)
class AgentProfile:
    """The skills and the runner of one instance."""

    skills: tuple[SkillSpec, ...]
    runner: RunnerSpec
    description: str = ""
    problems: tuple[str, ...] = ()  # entries ignored because they were invalid

    def skill(self, skill_id: str) -> SkillSpec | None:
        for s in self.skills:
            if s.id == skill_id:
                return s
        return None


def load_profile(
    instance_spec: dict[str, Any], loadout_spec: dict[str, Any] | None
) -> AgentProfile:
    """Read skills and runner from the instance spec, else its loadout; never raises."""
    problems: list[str] = []
    source = instance_spec if "skills" in instance_spec else (loadout_spec or {})
    skills: list[SkillSpec] = [SHELL_SKILL]
    raw_skills = source.get("skills") or []
    if not isinstance(raw_skills, list):
        problems.append("skills: must be a list")
        raw_skills = []
    for i, raw in enumerate(raw_skills):
        try:
            skill = SkillSpec.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            problems.append(f"skills[{i}].{loc}: {err['msg']}")
            continue
        if skill.id == SHELL_SKILL_ID:
            skills[0] = skill
        elif any(s.id == skill.id for s in skills):
            problems.append(f"skills[{i}].id: duplicate skill id {skill.id!r}")
        else:
            skills.append(skill)
    runner_source = (instance_spec if "task_runner" in instance_spec else (loadout_spec or {})).get(
        "task_runner"
    )
    runner = RunnerSpec()
    if runner_source is not None:
        try:
            runner = RunnerSpec.model_validate(
                {"argv": runner_source} if isinstance(runner_source, list) else runner_source
            )
        except ValidationError as exc:
            err = exc.errors()[0]
            problems.append(
                "task_runner." + ".".join(str(p) for p in err["loc"]) + f": {err['msg']}"
            )
    description = instance_spec.get("description") or (loadout_spec or {}).get("description")
    return AgentProfile(
        skills=tuple(skills),
        runner=runner,
        description=description if isinstance(description, str) else "",
        problems=tuple(problems),
    )


class Rejection(Exception):
    """Input no run can be made of: the task is created and rejected with this reason."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.field = field


@dataclass(frozen=True)
class RunPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    cwd: str | None = None
    budget: BudgetOut | None = None  # within the instance's loadout budgets (service.py)
    files: tuple[Any, ...] = ()  # InFile: the message's file parts (files.py)


def validate_data(skill: SkillSpec, data: Any, present: bool) -> None:
    """Check the data part against the skill's JSON Schema; raises Rejection naming the field."""
    if skill.input_schema is None:
        return
    if not present:
        raise Rejection(f"skill {skill.id!r} needs a data part matching its input schema", "data")
    validator = validator_for(skill.input_schema)(skill.input_schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        path = "data" + "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path
        )
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise Rejection(f"{path}: {err.message}{more}", path)


def plan_run(
    profile: AgentProfile,
    skill: SkillSpec,
    *,
    text: str,
    data: Any,
    has_data: bool,
    task_id: str,
    context_id: str,
) -> RunPlan:
    """The argv, environment and user of a run; raises Rejection for unusable input."""
    validate_data(skill, data, has_data)
    template = skill.runner or profile.runner.argv
    uses_text = any("{text}" in a for a in template)
    if uses_text and not text.strip():
        raise Rejection(f"skill {skill.id!r} needs a text part (the command to run)", "parts")
    data_json = json.dumps(data, separators=(",", ":"), ensure_ascii=False) if has_data else ""
    values = {
        "text": text,
        "data": data_json,
        "skill": skill.id,
        "task_id": task_id,
        "context_id": context_id,
    }
    argv = [_PLACEHOLDER.sub(lambda m: values[m.group(1)], a) for a in template]
    env = dict(profile.runner.env)
    env.update({"A2A_TASK_ID": task_id, "A2A_CONTEXT_ID": context_id, "A2A_SKILL": skill.id})
    if has_data:
        env["A2A_DATA"] = data_json
    if text and len(text.encode()) <= MAX_ENV_TEXT:
        env["A2A_TEXT"] = text
    for value in argv:
        if "\x00" in value:
            raise Rejection("the command must not contain NUL bytes", "parts")
    return RunPlan(argv=argv, env=env, user=profile.runner.user, cwd=profile.runner.cwd)


__all__ = [
    "SHELL_SKILL_ID",
    "AgentProfile",
    "Rejection",
    "RunPlan",
    "RunnerSpec",
    "SkillSpec",
    "load_profile",
    "plan_run",
    "validate_data",
]
