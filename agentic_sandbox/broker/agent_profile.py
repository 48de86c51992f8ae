"""An instance's agent profile as it is stored: its skills and its task runner.

The schemas live below the components because two of them meet here: the host-instance
registration (`agentlink`) validates what a caller declares, and the task layer
(`tasks.skills`) reads the same keys back from `instances.spec` (or the loadout) to build the
AgentCard and the argv of a run. One schema for both, so what registration accepts is exactly
what a task can run.
"""

from __future__ import annotations

import re
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

DEFAULT_ARGV = ("bash", "-lc", "{text}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SkillSpec(BaseModel):
    """One skill: what the AgentCard lists and, with `runner`, the argv that replaces the task
    runner's. `runner` is the loadout schema's name (`provision.loadouts.Skill`); `command`, the
    name host-instance registrations first used, is read as the same field.
    Stored records are read leniently (unknown keys ignored); `SkillDeclaration` is the request
    form, where an unknown key is an error."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    name: str = Field(min_length=1, max_length=200)
    description: str = Field(min_length=1, max_length=4000)
    tags: list[str] = Field(default_factory=list)
    examples: list[str] = Field(default_factory=list)
    input_schema: dict[str, Any] | None = None
    runner: list[str] | None = Field(
        default=None, min_length=1, validation_alias=AliasChoices("runner", "command")
    )

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                validator_for(value).check_schema(value)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return value


class RunnerSpec(BaseModel):
    """How a task's text becomes a run: an argv template, and the user, cwd and environment."""

    model_config = ConfigDict(extra="ignore")

    argv: list[str] = Field(default_factory=lambda: list(DEFAULT_ARGV), min_length=1)
    user: str | None = Field(default=None, max_length=64)
    cwd: str | None = Field(default=None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"invalid environment variable name {key!r}")
        return value


class SkillDeclaration(SkillSpec):
    """A skill as a caller declares it: unknown keys are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


class RunnerDeclaration(RunnerSpec):
    """A task runner as a caller declares it: unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")


def unique_skill_ids(skills: list[SkillDeclaration] | None) -> list[SkillDeclaration] | None:
    """The validator of a declared skill list: every id once (the built-in `shell` may be
    replaced, but only by one entry)."""
    seen: set[str] = set()
    for skill in skills or ():
        if skill.id in seen:
            raise ValueError(f"duplicate skill id {skill.id!r}")
        seen.add(skill.id)
    return skills


def stored_profile(
    skills: list[SkillDeclaration] | None, task_runner: RunnerDeclaration | None
) -> dict[str, Any]:
    """The `instances.spec` keys that `tasks.skills.load_profile` reads back."""
    out: dict[str, Any] = {}
    if skills is not None:
        out["skills"] = [s.model_dump(exclude_none=True) for s in skills]
    if task_runner is not None:
        out["task_runner"] = task_runner.model_dump(exclude_none=True)
    return out
