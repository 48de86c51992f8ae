"""What the admin API returns, as pydantic models.

Every model accepts fields it does not know (a newer server adds some; they are kept, see
`model_extra`) and remembers the document it was read from: `to_dict()` gives it back as the
server sent it (field order, time formats), which is what `sandboxctl -o json` prints. Each
model names the OpenAPI component it reads (`__schema__`), and a test checks its fields against
the server's `/api/openapi.json`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

TERMINAL_OPERATION_STATES = frozenset({"succeeded", "failed", "canceled"})
TERMINAL_TASK_STATES = frozenset({"completed", "failed", "canceled", "rejected"})


class ApiModel(BaseModel):
    # defer_build: a model's validator is made when it is first used, not at import (a CLI
    # call uses two or three of these models; building all of them cost most of its start).
    model_config = ConfigDict(extra="allow", defer_build=True)
    __schema__: ClassVar[str] = ""
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_document(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        obj = handler(data)
        if isinstance(data, dict) and isinstance(obj, ApiModel):
            obj._raw = data
        return obj

    def to_dict(self) -> dict[str, Any]:
        """The document as the server sent it."""
        return dict(self._raw) if self._raw else self.model_dump(mode="json")


class Page(ApiModel):
    """`items` plus the cursor of the next page (`next`) where the route has one."""


# ---- identity ------------------------------------------------------------------------------------
class WhoAmI(ApiModel):
    __schema__ = "WhoAmI"
    subject: str
    role: str
    kind: str = ""
    credential_id: str = ""


class Token(ApiModel):
    __schema__ = "TokenInfo"
    id: str
    subject: str
    role: str
    description: str = ""
    prefix: str = ""
    created_at: dt.datetime | None = None
    created_by: str | None = None
    expires_at: dt.datetime | None = None
    revoked_at: dt.datetime | None = None
    last_used_at: dt.datetime | None = None


class CreatedToken(Token):
    """A new token: `token` is its value, shown this once."""

    __schema__ = "TokenCreated"
    token: str


class ApiKey(ApiModel):
    __schema__ = "ApiKeyInfo"
    id: str
    instance_id: str
    owner: str = ""
    name: str = ""
    scopes: list[str] = Field(default_factory=list)
    prefix: str = ""
    created_at: dt.datetime | None = None
    expires_at: dt.datetime | None = None
    revoked_at: dt.datetime | None = None


class CreatedApiKey(ApiKey):
    __schema__ = "ApiKeyCreated"
    key: str


class Secret(ApiModel):
    """A secret's name and bindings; its value is never returned."""

    __schema__ = "SecretInfo"
    name: str
    owner: str = ""
    version: int = 0
    instances: list[str] = Field(default_factory=list)
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None


# ---- fleet ---------------------------------------------------------------------------------------
class Instance(ApiModel):
    __schema__ = "InstanceOut"
    id: str
    incarnation: str = ""
    kind: str = "vm"
    owner: str = ""
    state: str
    state_reason: str = ""
    agent_state: str = ""
    host: str | None = None
    image: str | None = None
    loadout: str | None = None
    loadout_version: int | None = None  # the exact version it was made from (None: inline)
    loadout_digest: str | None = None
    vcpus: int = 0
    memory_mib: int = 0
    disk_gib: int | None = None
    network_policy: str = ""
    ssh_port: int | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None

    @property
    def ready(self) -> bool:
        """Running with its agent connected: sessions and tasks can start."""
        return self.state == "running" and self.agent_state == "connected"


class EgressRule(ApiModel):
    """One allowed destination: a host name, `*.suffix` or an address literal, a port, and
    the plain-HTTP methods allowed there (empty: any, and `CONNECT`)."""

    __schema__ = "Rule"
    host: str
    port: int
    methods: list[str] = Field(default_factory=list)

    @property
    def text(self) -> str:
        """The rule's text form, `HOST:PORT[:METHOD,…]` (what `--allow` takes)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        tail = f":{','.join(self.methods)}" if self.methods else ""
        return f"{host}:{self.port}{tail}"


class EgressLimits(ApiModel):
    """The proxy's limits for one instance: connections at once, and bytes per second each
    way over all its connections (0: no limit)."""

    __schema__ = "EgressLimits"
    max_connections: int = 0
    bandwidth_bytes_per_second: int = 0


class EgressCredential(ApiModel):
    """A brokered credential: the proxy sets `header` to `format` (with the secret's value for
    `{value}`) on the requests to `destinations`; the value itself is never shown."""

    __schema__ = "BrokeredCredential"
    secret: str
    destinations: list[str] = Field(default_factory=list)
    header: str = "Authorization"
    format: str = "Bearer {value}"


class Egress(ApiModel):
    """An instance's egress policy (`network`: isolated, allowlist or nat), its allowlist,
    the proxy's limits for it and its brokered credentials."""

    __schema__ = "EgressOut"
    instance_id: str
    incarnation: str = ""
    network: str
    allow: list[EgressRule] = Field(default_factory=list)
    limits: EgressLimits = Field(default_factory=EgressLimits)
    credentials: list[EgressCredential] = Field(default_factory=list)


class ExecStream(ApiModel):
    __schema__ = "StreamOut"
    data: str = ""
    bytes: int = 0
    truncated: bool = False


class ExecUsage(ApiModel):
    __schema__ = "UsageOut"
    cpu_seconds: float = 0.0
    peak_memory_bytes: int = 0
    output_bytes: int = 0
    network_egress_bytes: int = 0  # bytes its egress proxy connections sent (allowlist guests)
    network_ingress_bytes: int = 0  # and received


class ExecBudget(ApiModel):
    """The budget a run had (None: no limit)."""

    __schema__ = "BudgetOut"
    timeout_seconds: float | None = None
    memory_mib: int | None = None
    cpus: float | None = None
    pids: int | None = None
    output_bytes: int | None = None


class ExecResult(ApiModel):
    """A command's end: `exit_code` (None when a `signal` ended it), the budget `reason` that
    ended it (timeout, memory, pids, output-limit, canceled) or None, its output (text, or
    base64 with `encoding == "base64"`), usage and the budget it had."""

    __schema__ = "ExecOut"
    exec_id: str
    instance_id: str
    pid: int = 0
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None
    stdout: ExecStream = Field(default_factory=ExecStream)
    stderr: ExecStream = Field(default_factory=ExecStream)
    encoding: str = "text"
    duration_seconds: float = 0.0
    usage: ExecUsage = Field(default_factory=ExecUsage)
    budget: ExecBudget = Field(default_factory=ExecBudget)
    enforcement: str = ""


# ---- files ------------------------------------------------------------------------------------
class FileInfo(ApiModel):
    """A path in an instance: `type` file, directory, symlink or other; `mode` in octal."""

    __schema__ = "FileInfoOut"
    path: str
    name: str
    type: str
    size: int = 0
    mode: str = ""
    uid: int = 0
    gid: int = 0
    owner: str = ""
    group: str = ""
    mtime: float = 0.0
    link_target: str | None = None


class FileList(ApiModel):
    __schema__ = "FileListOut"
    path: str
    items: list[FileInfo] = Field(default_factory=list)
    truncated: bool = False


class Upload(ApiModel):
    """What an upload kept: its size and SHA-256 (checked against what was sent)."""

    __schema__ = "UploadOut"
    path: str
    size: int
    sha256: str
    directory: bool = False
    entries: int | None = None


class Removed(ApiModel):
    __schema__ = "RemovedOut"
    path: str
    removed: int = 0


class Download(NamedTuple):
    """What a download wrote: the remote path, its `type` (file or directory, which came as a
    tar stream), the bytes received and their SHA-256."""

    path: str
    type: str
    size: int
    sha256: str


class HostInstance(ApiModel):
    """The record of an agent-client running on the control host (development, tests)."""

    __schema__ = "HostInstance"
    id: str
    incarnation: str = ""
    owner: str = ""
    state: str = ""
    agent_state: str = ""
    kind: str = ""
    description: str = ""
    created_at: dt.datetime | None = None


class EnrollmentToken(ApiModel):
    __schema__ = "EnrollmentTokenCreated"
    id: str
    instance_id: str
    token: str
    expires_at: dt.datetime | None = None
    ca_certificate: str = ""
    grpc_listen: str = ""
    grpc_enroll_listen: str = ""
    server_name: str = ""


class Agent(ApiModel):
    __schema__ = "AgentStatus"
    instance_id: str
    owner: str = ""
    state: str
    connected_at: dt.datetime | None = None
    last_heartbeat_at: dt.datetime | None = None
    agent_version: str = ""
    agent_bundle: str = ""
    bundle_problem: str = ""
    hostname: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict)


class AgentBundle(ApiModel):
    """An agent bundle the server can roll out: its own (`builtin`) or an uploaded one."""

    __schema__ = "BundleOut"
    digest: str
    version: str
    size: int
    builtin: bool = False
    created_by: str = ""
    created_at: dt.datetime | None = None


class Operation(ApiModel):
    """Long-running work (provisioning, clones, image builds, pools) with stages and progress."""

    __schema__ = "OperationOut"
    id: str
    kind: str
    subject_type: str = ""
    subject_id: str = ""
    owner: str = ""
    state: str
    stage: str | None = None
    progress: float = 0.0
    stages: list[dict[str, Any]] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_OPERATION_STATES


class Snapshot(ApiModel):
    __schema__ = "SnapshotOut"
    id: str
    instance_id: str
    name: str
    kind: str = ""
    state: str = ""
    created_at: dt.datetime | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class Console(ApiModel):
    __schema__ = "ConsoleOut"
    instance_id: str
    size: int = 0
    text: str = ""


class Host(ApiModel):
    __schema__ = "HostOut"
    name: str
    uri: str
    labels: dict[str, str] = Field(default_factory=dict)
    control_address: str = ""
    files: str = ""
    state: str = ""
    reason: str = ""
    accel: str | None = None
    cpus: int = 0
    memory_mib: int = 0
    free_memory_mib: int = 0
    committed_vcpus: int = 0
    committed_memory_mib: int = 0
    instances: int = 0
    draining: bool = False


class LibvirtdCertificate(ApiModel):
    """A libvirtd's TLS files from the server's CA (its key stays where it was made)."""

    __schema__ = "LibvirtdCertificate"
    cacert_pem: str
    servercert_pem: str


class PoolMove(ApiModel):
    """What a drain does with one of the host's warm pools: `moving` (operation_id) or
    `stuck` (reason: no other host can take it; its members stay)."""

    __schema__ = "PoolMoveOut"
    key: str
    state: str
    operation_id: str | None = None
    reason: str = ""


class HostDrain(Host):
    """A drained host, and what happens to the warm pools that were on it."""

    __schema__ = "HostDrainOut"
    pools: list[PoolMove] = Field(default_factory=list)


class Image(ApiModel):
    __schema__ = "ImageOut"
    name: str
    kind: str = ""
    recipe: str | None = None
    state: str = ""
    size_bytes: int | None = None
    created_at: dt.datetime | None = None


class Loadout(ApiModel):
    """A loadout's active version, resolved (`extends` applied)."""

    __schema__ = "LoadoutOut"
    name: str
    version: int = 0
    digest: str = ""
    owner: str = ""
    shared: bool = False
    description: str = ""
    network: str = ""
    resources: dict[str, int] = Field(default_factory=dict)
    packages: list[str] = Field(default_factory=list)
    skills: list[dict[str, Any]] = Field(default_factory=list)
    task_runner: dict[str, Any] = Field(default_factory=dict)
    sudo: bool = False


class LoadoutExtends(ApiModel):
    __schema__ = "ExtendsOut"
    name: str
    version: int


class LoadoutVersion(ApiModel):
    """One immutable version of a loadout: the spec as saved, its digest, what it resolved to."""

    __schema__ = "LoadoutVersionOut"
    name: str
    version: int
    digest: str = ""
    active: bool = False
    extends: LoadoutExtends | None = None
    spec: dict[str, Any] = Field(default_factory=dict)
    resolved: dict[str, Any] = Field(default_factory=dict)
    created_by: str = ""
    created_at: dt.datetime | None = None


class LoadoutSaved(LoadoutVersion):
    """What a save answers: the version, and whether this save made it (false: identical
    content was saved before)."""

    __schema__ = "LoadoutSaved"
    created: bool = False


class LoadoutVersions(ApiModel):
    __schema__ = "LoadoutVersionList"
    name: str
    owner: str = ""
    shared: bool = False
    active_version: int = 0
    items: list[LoadoutVersion] = Field(default_factory=list)


class LoadoutActivated(ApiModel):
    __schema__ = "LoadoutActivated"
    name: str
    active_version: int
    previous_version: int


class Pool(ApiModel):
    __schema__ = "PoolOut"
    key: str
    image: str = ""
    loadout: str = ""
    loadout_version: int | None = None
    network: str = ""
    size: int = 0
    ready: int = 0
    last_error: str = ""


# ---- sessions ------------------------------------------------------------------------------------
class OutputRange(ApiModel):
    __schema__ = "OutputRange"
    start: int
    end: int


class Member(ApiModel):
    __schema__ = "Member"
    id: str
    subject: str
    role: str


class Session(ApiModel):
    __schema__ = "SessionInfo"
    id: str
    instance_id: str
    owner: str = ""
    name: str = ""
    command: list[str] | None = None
    cols: int = 80
    rows: int = 24
    cwd: str | None = None
    user: str | None = None
    state: str
    task_id: str | None = None
    exit_code: int | None = None
    exit_signal: str | None = None
    exit_reason: str = ""
    created_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    output: OutputRange | None = None
    held: bool = False
    agent_connected: bool = False
    controller: str | None = None
    observers: int = 0
    members: list[Member] = Field(default_factory=list)
    recording: bool = False


class Cursor(ApiModel):
    __schema__ = "Cursor"
    x: int
    y: int
    hidden: bool = False


class Screen(ApiModel):
    __schema__ = "ScreenInfo"
    session_id: str
    cols: int
    rows: int
    cursor: Cursor | None = None
    lines: list[str] = Field(default_factory=list)
    text: str = ""
    scrollback: list[str] = Field(default_factory=list)
    offset: int = 0


class Output(NamedTuple):
    """A piece of a session's output: its first byte's offset in the session's stream."""

    offset: int
    data: bytes

    @property
    def end(self) -> int:
        return self.offset + len(self.data)


class SessionExit(NamedTuple):
    code: int | None
    signal: str | None
    reason: str
    lost: bool


# ---- tasks ---------------------------------------------------------------------------------------
class Task(ApiModel):
    """A task (the admin API's mission view of it)."""

    __schema__ = "Mission"
    id: str
    instance_id: str
    owner: str = ""
    context_id: str = ""
    state: str
    skill: str | None = None
    session_id: str | None = None
    exit_code: int | None = None
    status_message: str | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    status_at: dt.datetime | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_TASK_STATES


class Run(ApiModel):
    __schema__ = "RunOut"
    id: str
    attempt: int = 1
    session_id: str | None = None
    state: str = ""
    exit_code: int | None = None
    reason: str = ""
    output_bytes: int = 0
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None


class Transition(ApiModel):
    __schema__ = "TransitionOut"
    time: dt.datetime
    actor: str = ""
    from_state: str | None = None
    to_state: str | None = None
    cause: str = ""


class TaskDetail(Task):
    __schema__ = "MissionDetail"
    runs: list[Run] = Field(default_factory=list)
    transitions: list[Transition] = Field(default_factory=list)


class SubmittedTask(Task):
    """A task as the v1 API returns it: the mission fields and its output so far."""

    __schema__ = "V1Task"
    output: str | None = None


class TaskPage(Page):
    __schema__ = "MissionPage"
    items: list[Task]
    totals: dict[str, int] = Field(default_factory=dict)
    next_cursor: str | None = None


# ---- observability -------------------------------------------------------------------------------
class Event(ApiModel):
    __schema__ = "EventOut"
    seq: int
    type: str
    time: dt.datetime
    actor: str | None = None
    instance_id: str | None = None
    session_id: str | None = None
    task_id: str | None = None
    host: str | None = None
    correlation_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class EventPage(Page):
    """Events after a cursor, oldest first; `next` is the cursor to read on from."""

    __schema__ = "EventPage"
    items: list[Event]
    next: int
    last_seq: int = 0


class AuditEntry(ApiModel):
    __schema__ = "AuditOut"
    id: int
    time: dt.datetime
    actor: str
    action: str
    subject_type: str = ""
    subject_id: str = ""
    outcome: str = ""
    cause: str = ""
    from_state: str | None = None
    to_state: str | None = None
    correlation_id: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


class AuditPage(Page):
    __schema__ = "AuditPage"
    items: list[AuditEntry]
    next: int


# ---- A2A -----------------------------------------------------------------------------------------
class VerifiedCard(NamedTuple):
    """An AgentCard whose signature verified, and who signed it."""

    card: dict[str, Any]
    kid: str
    jwk: dict[str, Any]  # the public key (from the instance's JWKS) that verified it
    jwks_url: str
    header: dict[str, Any]  # the signature's protected header
