"""Base models for API input and output, and shared field types."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

InstanceId = Annotated[
    str,
    StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$"),
    Field(description="instance id: [a-z0-9][a-z0-9-]{0,62}"),
]
SubjectName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")]
# an environment variable's name, for every request that sets a run's environment
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]


def nul_free_values(value: dict[str, str]) -> dict[str, str]:
    """An environment's values, refused when one holds a NUL byte (no process can get it)."""
    if any("\x00" in v for v in value.values()):
        raise ValueError("values cannot contain NUL bytes")
    return value


class Input(BaseModel):
    """Request bodies and queries: unknown fields are an error, never silently dropped."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class Output(BaseModel):
    model_config = ConfigDict(from_attributes=True)


def iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
