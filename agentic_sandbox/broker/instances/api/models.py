"""Models and field types more than one of the fleet's route modules answer with or accept."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import Field, StringConstraints

from agentic_sandbox.broker.http.schemas import Output
from agentic_sandbox.broker.instances.access import instance_kind
from agentic_sandbox.broker.store import models as m

SnapshotName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]
HostName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
SshKey = Annotated[
    str,
    StringConstraints(
        pattern=r"^(ssh-(ed25519|rsa|dss)|ecdsa-sha2-nistp(256|384|521)|sk-[a-z0-9@.-]+) "
        r"[A-Za-z0-9+/=]+( [^\n\r]{0,200})?$",
        max_length=16384,
    ),
]
JsonObject = dict[str, object]


class OperationOut(Output):
    id: str
    kind: str
    subject_type: str
    subject_id: str
    owner: str
    state: str
    stage: str | None
    progress: float
    stages: list[JsonObject]
    error: JsonObject | None
    result: JsonObject | None
    created_at: dt.datetime
    updated_at: dt.datetime


class InstanceOut(Output):
    id: str
    incarnation: str = Field(
        description="this create of the id: a new instance with the same id has another"
    )
    kind: str = Field(default="vm", description="vm, or host-agent (an agent on the host)")
    owner: str
    state: str
    state_reason: str
    agent_state: str
    host: str | None
    image: str | None
    loadout: str | None
    loadout_version: int | None = Field(
        default=None,
        description="the exact loadout version it was made from (null: an inline loadout)",
    )
    loadout_digest: str | None = Field(default=None, description="that version's SHA-256")
    vcpus: int
    memory_mib: int
    disk_gib: int | None = None
    network_policy: str
    ssh_port: int | None
    created_at: dt.datetime
    updated_at: dt.datetime


def instance_out(row: m.Instance) -> InstanceOut:
    out = InstanceOut.model_validate(row)
    return out.model_copy(update={"kind": instance_kind(row)})
