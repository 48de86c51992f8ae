"""The relational schema: one table per noun of the spec's vocabulary.

Every owned object carries `owner` (the subject of the operator token that created it). Times are
timezone-aware UTC. Large byte streams (recordings, serial logs) live as files under the data
directory and are referenced by path. Later work adds columns through Alembic migrations.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_incarnation() -> str:
    return str(uuid.uuid4())


#: An instance incarnation: the immutable UUID of one create of an instance id (see
#: boundary.md, Incarnations). Rows bound to an instance carry the incarnation they belong to.
IncarnationId = String(36)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Stores aware datetimes; SQLite hands back naive ones, which are UTC by construction."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC)

    def process_result_value(
        self, value: dt.datetime | None, dialect: Dialect
    ) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value


NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets BIGINT.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dt.datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Timestamps:
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


# --------------------------------------------------------------------------------------------
# Identity and access
# --------------------------------------------------------------------------------------------
class OperatorToken(Base, Timestamps):
    __tablename__ = "operator_tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    subject: Mapped[str] = mapped_column(String(128), index=True)  # the owner name it acts as
    role: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(String(256), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str | None] = mapped_column(String(128))
    expires_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]
    last_used_at: Mapped[dt.datetime | None]


class WebSession(Base):
    """A dashboard login: an HttpOnly cookie bound to an operator token, with a CSRF token."""

    __tablename__ = "web_sessions"
    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[str] = mapped_column(ForeignKey("operator_tokens.id", ondelete="CASCADE"))
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime]


class ApiKey(Base, Timestamps):
    """An A2A key bound to one instance (agent) with scopes such as a2a:read, a2a:invoke."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    incarnation: Mapped[str] = mapped_column(IncarnationId)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    scopes: Mapped[list[Any]] = mapped_column(default=list)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    expires_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]
    last_used_at: Mapped[dt.datetime | None]


class Share(Base):
    """Grants a subject access to another owner's object (read, or read+control)."""

    __tablename__ = "shares"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    object_type: Mapped[str] = mapped_column(String(32))
    object_id: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str] = mapped_column(String(128))
    access: Mapped[str] = mapped_column(String(16), default="read")
    incarnation: Mapped[str | None] = mapped_column(IncarnationId)  # of a shared instance
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("object_type", "object_id", "subject"),)


class Secret(Base, Timestamps):
    """A write-only value, encrypted at rest with the data directory's key."""

    __tablename__ = "secrets"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(128))
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    version: Mapped[int] = mapped_column(default=1)
    __table_args__ = (UniqueConstraint("owner", "name"),)


class AgentBundle(Base):
    """An agent bundle uploaded for rollouts (the server's own is built from its files)."""

    __tablename__ = "agent_bundles"
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)  # SHA-256 of `data`
    version: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column()
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class SecretBinding(Base):
    __tablename__ = "secret_bindings"
    secret_id: Mapped[str] = mapped_column(
        ForeignKey("secrets.id", ondelete="CASCADE"), primary_key=True
    )
    instance_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    incarnation: Mapped[str] = mapped_column(IncarnationId)
    env_name: Mapped[str | None] = mapped_column(String(128))


# --------------------------------------------------------------------------------------------
# Fleet
# --------------------------------------------------------------------------------------------
class Host(Base, Timestamps):
    __tablename__ = "hosts"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    uri: Mapped[str] = mapped_column(String(512))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    capacity_vcpus: Mapped[int | None]
    capacity_memory_mib: Mapped[int | None]
    state: Mapped[str] = mapped_column(String(16), default="unknown")
    state_reason: Mapped[str] = mapped_column(Text, default="")
    owner: Mapped[str] = mapped_column(String(128), default="admin")
    # takes no new placements (POST …/hosts/{name}/drain); kept across restarts
    draining: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Image(Base, Timestamps):
    __tablename__ = "images"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)  # <recipe>-<hash12>
    recipe: Mapped[str | None] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16), default="built")  # built | cloud
    content_hash: Mapped[str | None] = mapped_column(String(64))
    path: Mapped[str | None] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default="building")
    manifest: Mapped[dict[str, Any]] = mapped_column(default=dict)
    owner: Mapped[str] = mapped_column(String(128), index=True)


class Loadout(Base, Timestamps):
    """A loadout name: who owns it and which of its versions is active (the pointer that
    activation moves by compare-and-set). `owner` is the creator's subject; `shared` ones
    (the shipped files, or saved so by an admin) are read by everyone and changed by admins."""

    __tablename__ = "loadouts"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    source: Mapped[str] = mapped_column(String(16), default="builtin")  # builtin | api
    owner: Mapped[str] = mapped_column(String(128), index=True)
    shared: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    active_version: Mapped[int] = mapped_column(default=1, server_default="1")


class LoadoutVersion(Base):
    """One immutable version of a loadout: `document` is what was saved (the spec, and the
    parent version `extends` was pinned to), `digest` the SHA-256 of its canonical JSON
    (RFC 8785), `resolved` the loadout with `extends` applied. Numbers count up per name."""

    __tablename__ = "loadout_versions"
    name: Mapped[str] = mapped_column(
        ForeignKey("loadouts.name", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    digest: Mapped[str] = mapped_column(String(64))
    document: Mapped[dict[str, Any]] = mapped_column()
    resolved: Mapped[dict[str, Any]] = mapped_column()
    extends_name: Mapped[str | None] = mapped_column(String(63))
    extends_version: Mapped[int | None]
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("name", "digest"),)


class Instance(Base, Timestamps):
    __tablename__ = "instances"
    id: Mapped[str] = mapped_column(String(63), primary_key=True)
    incarnation: Mapped[str] = mapped_column(IncarnationId, default=new_incarnation, unique=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    host: Mapped[str | None] = mapped_column(String(63), index=True)
    image: Mapped[str | None] = mapped_column(String(128))
    loadout: Mapped[str | None] = mapped_column(String(63))
    # the exact loadout version it was made from (None: an inline loadout, or made before
    # loadouts had versions); activating another version never changes it
    loadout_version: Mapped[int | None]
    loadout_digest: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    state_reason: Mapped[str] = mapped_column(Text, default="")
    agent_state: Mapped[str] = mapped_column(String(16), default="absent")
    vcpus: Mapped[int] = mapped_column(default=1)
    memory_mib: Mapped[int] = mapped_column(default=512)
    disk_gib: Mapped[int] = mapped_column(default=4)
    network_policy: Mapped[str] = mapped_column(String(16), default="isolated")
    ssh_port: Mapped[int | None]
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    version: Mapped[int] = mapped_column(default=1)
    deleted_at: Mapped[dt.datetime | None]


class Snapshot(Base):
    __tablename__ = "snapshots"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    name: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))  # disk | memory
    state: Mapped[str] = mapped_column(String(16), default="ready")
    owner: Mapped[str] = mapped_column(String(128), index=True)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("instance_id", "name"),)


class Operation(Base, Timestamps):
    """Long-running work (provisioning, image builds) with stages, progress and timings."""

    __tablename__ = "operations"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    subject_type: Mapped[str] = mapped_column(String(32))
    subject_id: Mapped[str] = mapped_column(String(128), index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    stage: Mapped[str | None] = mapped_column(String(32))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    stages: Mapped[list[Any]] = mapped_column(default=list)  # [{name, started_at, seconds}]
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class EnrollmentToken(Base):
    __tablename__ = "enrollment_tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    incarnation: Mapped[str] = mapped_column(IncarnationId)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime]
    used_at: Mapped[dt.datetime | None]


class AgentCertificate(Base):
    __tablename__ = "agent_certificates"
    serial: Mapped[str] = mapped_column(String(64), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    incarnation: Mapped[str] = mapped_column(IncarnationId, index=True)
    not_before: Mapped[dt.datetime]
    not_after: Mapped[dt.datetime]
    revoked_at: Mapped[dt.datetime | None]


class AgentLink(Base):
    """Which server process owns an agent's stream, so another process can route to it."""

    __tablename__ = "agent_links"
    instance_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    server_id: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))  # connected | stale | disconnected
    connected_at: Mapped[dt.datetime | None]
    last_heartbeat_at: Mapped[dt.datetime | None]
    agent_version: Mapped[str] = mapped_column(String(64), default="")
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)


class InstanceKey(Base):
    """The instance's own Ed25519 key that signs its AgentCard (private part encrypted)."""

    __tablename__ = "instance_keys"
    kid: Mapped[str] = mapped_column(String(64), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    incarnation: Mapped[str] = mapped_column(IncarnationId)
    private_ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    public_jwk: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    retired_at: Mapped[dt.datetime | None]


# --------------------------------------------------------------------------------------------
# Sessions, tasks, runs
# --------------------------------------------------------------------------------------------
class Session(Base, Timestamps):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    incarnation: Mapped[str | None] = mapped_column(IncarnationId)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    command: Mapped[list[Any] | None] = mapped_column(JSON)
    cols: Mapped[int] = mapped_column(default=80)
    rows: Mapped[int] = mapped_column(default=24)
    cwd: Mapped[str | None] = mapped_column(Text)
    user: Mapped[str | None] = mapped_column(String(64))
    env: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(16), default="starting", index=True)
    exit_code: Mapped[int | None]
    exit_signal: Mapped[str | None] = mapped_column(String(16))
    exit_reason: Mapped[str] = mapped_column(Text, default="")  # why it failed or was lost
    task_id: Mapped[str | None] = mapped_column(String(36), index=True)
    output_offset: Mapped[int] = mapped_column(BigInteger, default=0)  # acknowledged bytes
    recording_path: Mapped[str | None] = mapped_column(Text)
    ended_at: Mapped[dt.datetime | None]


class Task(Base, Timestamps):
    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(63), index=True)
    incarnation: Mapped[str | None] = mapped_column(IncarnationId)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    context_id: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(32), index=True)
    skill: Mapped[str | None] = mapped_column(String(128))
    message_id: Mapped[str | None] = mapped_column(String(128))
    status_message: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    history: Mapped[list[Any]] = mapped_column(default=list)
    artifacts: Mapped[list[Any]] = mapped_column(default=list)
    task_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    version: Mapped[int] = mapped_column(default=1)
    status_at: Mapped[dt.datetime] = mapped_column(default=utcnow)  # time of the last transition
    __table_args__ = (Index("ix_tasks_instance_updated", "instance_id", "updated_at"),)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(default=1)
    session_id: Mapped[str | None] = mapped_column(String(36))
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    exit_code: Mapped[int | None]
    reason: Mapped[str] = mapped_column(Text, default="")
    output_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    started_at: Mapped[dt.datetime | None]
    ended_at: Mapped[dt.datetime | None]
    # the run's budget (BudgetOut), the one it exceeded, and what it used (agent-measured)
    budget: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    exceeded: Mapped[str | None] = mapped_column(String(16))
    cpu_us: Mapped[int | None] = mapped_column(BigInteger)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)


class TaskEvent(Base):
    """The ordered stream of A2A events of one task (status and artifact updates)."""

    __tablename__ = "task_events"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("task_id", "seq"),)


class PushConfig(Base):
    __tablename__ = "push_configs"
    task_id: Mapped[str] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # unique within its task
    owner: Mapped[str] = mapped_column(String(128))
    url: Mapped[str] = mapped_column(Text)
    token: Mapped[str | None] = mapped_column(Text)
    authentication: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    scope: Mapped[str] = mapped_column(String(128), primary_key=True)  # instance / owner
    key: Mapped[str] = mapped_column(String(128), primary_key=True)  # e.g. messageId
    request_hash: Mapped[str] = mapped_column(String(64))
    result_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


# --------------------------------------------------------------------------------------------
# Observability
# --------------------------------------------------------------------------------------------
class Event(Base):
    __tablename__ = "events"
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    type: Mapped[str] = mapped_column(String(64), index=True)
    time: Mapped[dt.datetime]
    actor: Mapped[str | None] = mapped_column(String(128))
    instance_id: Mapped[str | None] = mapped_column(String(63))
    session_id: Mapped[str | None] = mapped_column(String(36))
    task_id: Mapped[str | None] = mapped_column(String(36))
    host: Mapped[str | None] = mapped_column(String(63))
    correlation_id: Mapped[str | None] = mapped_column(String(64))
    owner: Mapped[str | None] = mapped_column(String(128))
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    __table_args__ = (
        Index("ix_events_instance_seq", "instance_id", "seq"),
        Index("ix_events_task_seq", "task_id", "seq"),
    )


class AuditEntry(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    time: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    subject_type: Mapped[str] = mapped_column(String(32))
    subject_id: Mapped[str] = mapped_column(String(128))
    outcome: Mapped[str] = mapped_column(String(16))  # ok | denied | failed
    cause: Mapped[str] = mapped_column(Text, default="")
    from_state: Mapped[str | None] = mapped_column(String(32))
    to_state: Mapped[str | None] = mapped_column(String(32))
    correlation_id: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    __table_args__ = (Index("ix_audit_subject", "subject_type", "subject_id", "id"),)


class KeyValue(Base):
    """Small server-wide facts (schema notes, server ids, counters)."""

    __tablename__ = "kv"
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[dict[str, Any]] = mapped_column(default=dict)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ControlTerm(Base):
    """The one row (id 1) naming the current leader of the control hosts sharing this database.

    The node that wins the election lock bumps `term`; every write transaction of a leader
    checks, before it commits, that the term is still its own (`Database.fence`)."""

    __tablename__ = "control_term"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    term: Mapped[int] = mapped_column(BigInteger, default=0)
    leader_node: Mapped[str | None] = mapped_column(String(63))
    leader_http_url: Mapped[str | None] = mapped_column(String(2048))
    leader_grpc: Mapped[str | None] = mapped_column(String(255))
    since: Mapped[dt.datetime | None] = mapped_column()


class ControlNode(Base):
    """A control host seen on this database (a heartbeat, not fenced)."""

    __tablename__ = "control_nodes"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    http_url: Mapped[str] = mapped_column(String(2048))
    grpc_address: Mapped[str] = mapped_column(String(255))
    version: Mapped[str] = mapped_column(String(32))
    role: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[dt.datetime] = mapped_column()
    seen_at: Mapped[dt.datetime] = mapped_column()
