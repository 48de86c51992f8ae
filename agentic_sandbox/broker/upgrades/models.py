"""The upgrades API's bodies and answers (`/api/v2/admin/agent-bundles`, `…/agent-rollouts`)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import Field, StringConstraints

from agentic_sandbox.broker.http.schemas import Input, InstanceId, Output

Digest = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9a-f]{64}$"),
    Field(description="a bundle's SHA-256, 64 lowercase hex digits"),
]


class BundleOut(Output):
    digest: str = Field(description="SHA-256 of the bundle (what an agent reports running)")
    version: str = Field(description="what the bundle's manifest names")
    size: int
    builtin: bool = Field(description="the server's own agent (built from its files)")
    created_by: str = ""
    created_at: dt.datetime | None = None


class BundleList(Output):
    items: list[BundleOut]


class RolloutRequest(Input):
    bundle: Digest | None = Field(
        default=None, description="the bundle to roll out (default: the server's own agent)"
    )
    instances: list[InstanceId] | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="the instances, in this order (default: every connected agent, by id)",
    )
    trial_seconds: int = Field(
        default=120,
        ge=10,
        le=3600,
        description="how long each new agent has to link and hear the server before it is "
        "rolled back",
    )
