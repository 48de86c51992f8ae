"""Server configuration: `SANDBOX_*` environment variables over an optional TOML file.

Every setting has a working default on one machine. Unknown keys (in the file or as `SANDBOX_*`
variables) and invalid values fail start-up with a message naming the key.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "SANDBOX_"


class ConfigError(Exception):
    """Configuration that cannot be used; the message names the key and the problem."""


class MetricsAccess(StrEnum):
    token = "token"  # on the main listener, needs any operator token
    public = "public"  # on the main listener, anonymous (only sensible on loopback)
    listener = "listener"  # on a separate listener (SANDBOX_METRICS_LISTEN), anonymous


class EventLoop(StrEnum):
    auto = "auto"
    asyncio = "asyncio"
    uvloop = "uvloop"


def default_node_name() -> str:
    return socket.gethostname().split(".", 1)[0] or "node"


def default_data_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/agentic-sandbox")
    return Path.home() / ".local" / "share" / "agentic-sandbox"


def parse_listen(value: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 as `[::1]:port`) and check both parts."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    return host, port


class Settings(BaseSettings):
    """All server settings. Field `foo_bar` is `SANDBOX_FOO_BAR` or `foo_bar` in the TOML file."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, frozen=True
    )

    data_dir: Path = Field(default_factory=default_data_dir)
    http_listen: str = "127.0.0.1:8122"
    grpc_listen: str = "127.0.0.1:8120"
    database_url: str | None = None
    node_name: str = Field(
        default_factory=default_node_name,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="this control host's name among the nodes sharing one PostgreSQL "
        "(default: the host name); letters, digits, '.', '_' and '-'",
    )
    libvirt_uri: str = Field(
        default="qemu:///system",
        description="libvirt URI of the local host; empty disables libvirt (no fleet)",
    )
    public_url: str | None = None
    qemu_group: str = Field(
        default="libvirt-qemu",
        max_length=64,
        description="the group QEMU runs with; the data dir and the fleet's folders are "
        "root:<it> 0710 when the server runs as root (no other local user gets in)",
    )

    log_level: str = "INFO"
    log_format: str = Field(default="json", pattern="^(json|text)$")
    event_loop: EventLoop = EventLoop.auto

    max_body_bytes: int = Field(default=1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    shutdown_grace_seconds: float = Field(default=10.0, ge=0, le=600)

    metrics_access: MetricsAccess = MetricsAccess.token
    metrics_listen: str = "127.0.0.1:8123"

    admin_token_file: Path | None = None  # default: <data_dir>/admin-token
    cookie_secure: bool = False  # set when the public URL is https
    web_session_ttl_seconds: int = Field(default=12 * 3600, ge=60)

    rate_limit_per_minute: int = Field(default=600, ge=1)
    rate_limit_burst: int = Field(default=120, ge=1)

    # ---- HTTP connections, refusals, streams -------------------------------------------------
    http_idle_timeout_seconds: float = Field(
        default=15.0,
        ge=0.5,
        le=3600,
        description="a connection that has not sent a complete request head this long after "
        "it opened (or after its previous response) is closed; WebSocket and SSE streams in "
        "progress are not affected",
    )
    http_body_timeout_seconds: float = Field(
        default=30.0,
        ge=0.5,
        le=3600,
        description="a request body must have arrived completely this long after its handler "
        "starts reading it (else 408)",
    )
    http_max_connections_per_address: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="open HTTP connections (streams included) from one remote address; more "
        "are answered 429 and closed",
    )
    auth_refusal_burst: int = Field(
        default=20,
        ge=1,
        le=1_000_000,
        description="refused requests without a valid credential one remote address may make "
        "at once before further ones are answered 429",
    )
    auth_refusals_per_minute: int = Field(
        default=20, ge=1, le=1_000_000, description="refill rate of that allowance"
    )
    auth_refusal_window_seconds: float = Field(
        default=60.0,
        ge=0.5,
        le=86_400,
        description="refusals from one address (or credential) are audited once per window; "
        "the rest of the window becomes one summary entry with a count",
    )
    streams_max_per_credential: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="open WebSocket and SSE streams per credential (revocation closes them all)",
    )
    sse_keepalive_seconds: float = Field(
        default=15.0, ge=0.1, le=3600, description="an idle SSE stream sends a comment this often"
    )

    events_ring_size: int = Field(default=10_000, ge=100, le=10_000_000)
    events_retention: int = Field(default=1_000_000, ge=1000)
    sse_client_queue: int = Field(default=1000, ge=10, le=1_000_000)

    # ---- fleet, images, provisioning ---------------------------------------------------------
    images_dir: Path | None = Field(
        default=None, description="guest image cache (default <data_dir>/images)"
    )
    loadouts_dir: Path | None = Field(
        default=None, description="extra loadout YAML files (default <data_dir>/loadouts)"
    )
    default_recipe: str = Field(default="debian-12-agent", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    provision_ready_timeout_seconds: float = Field(
        default=240.0,
        ge=5,
        le=3600,
        description="how long a provision waits for the agent to enroll; a guest whose console "
        "still advances then may take up to provision_ready_limit_seconds",
    )
    provision_ready_limit_seconds: float = Field(
        default=900.0,
        ge=5,
        le=7200,
        description="the longest a slowly booting guest (console still advancing) may take to "
        "enroll when the request names no ready_timeout_seconds",
    )
    max_instances_per_owner: int = Field(default=50, ge=1, le=100_000)
    max_concurrent_provisions: int = Field(default=4, ge=1, le=256)
    kvm_probe: bool = Field(default=True, description="probe KVM at start (else assume TCG)")
    host_keepalive_seconds: int = Field(
        default=5,
        ge=1,
        le=300,
        description="libvirt keepalive to each host: a host that misses host_keepalive_count "
        "answers in a row is unreachable (its instances unknown) and is reconnected",
    )
    host_keepalive_count: int = Field(default=3, ge=1, le=100)
    host_reconnect_max_seconds: float = Field(
        default=10.0, gt=0, le=600, description="the longest wait between reconnect attempts"
    )
    pool_refill_delay_seconds: float = Field(
        default=15.0,
        ge=0,
        le=3600,
        description="wait after a warm-pool hand-off before restoring its replacement, so the "
        "refill does not compete with the guest just handed out while it enrolls",
    )

    # ---- agent link (gRPC) ----------------------------------------------------------------
    grpc_enroll_listen: str = Field(
        default="127.0.0.1:8121",
        description="server-auth TLS listener for Enroll (agents have no certificate yet); "
        "Connect and Renew use grpc_listen with mutual TLS",
    )
    guest_link_listen: str = Field(
        default="127.0.0.1:8124",
        description="where guests' agents come in: the host side of every guest's forward "
        "(agentic_sandbox.broker.agentlink.gateway); it passes each guest connection on to "
        "grpc_listen or grpc_enroll_listen",
    )
    guest_link_addresses: list[str] = Field(
        default_factory=list,
        description="more addresses (IP literals, a JSON list) the guest link gateway listens "
        "on, at guest_link_listen's port: the control_address of each host whose guests reach "
        "this server over a network. They are also named in the server certificate. Firewall "
        "that port to the hypervisors: whoever reaches it reaches enrollment (a one-time "
        "token) and the link (mutual TLS)",
    )
    grpc_tls_names: list[str] = Field(
        default_factory=list,
        description="extra DNS names / IPs in the gRPC server certificate (agents verify the "
        "name agentic-sandbox-server by default)",
    )
    agent_heartbeat_seconds: float = Field(default=5.0, ge=0.05, le=300)
    agent_stale_after_heartbeats: int = Field(default=3, ge=2, le=100)
    agent_disconnect_after_heartbeats: int = Field(default=12, ge=3, le=1000)
    agent_cert_ttl_seconds: int = Field(default=7 * 86400, ge=10, le=366 * 86400)
    enrollment_token_ttl_seconds: int = Field(default=3600, ge=10, le=30 * 86400)
    agent_outbox_messages: int = Field(default=10_000, ge=100, le=1_000_000)
    agent_streams_per_link: int = Field(
        default=128, ge=1, le=100_000, description="byte streams (execs, …) at once per agent link"
    )

    # ---- exec --------------------------------------------------------------------------------
    exec_max_per_instance: int = Field(
        default=16, ge=1, le=10_000, description="execs running at once on one instance (429)"
    )
    exec_max_stdin_bytes: int = Field(
        default=512 * 1024,
        ge=0,
        le=1024**3,
        description="stdin an exec request may carry (413); the body limit "
        "(SANDBOX_MAX_BODY_BYTES) must leave room for it",
    )
    exec_output_default_bytes: int = Field(
        default=1024 * 1024, ge=0, le=1024**3, description="stdout/stderr kept per stream"
    )
    exec_output_max_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=0,
        le=1024**3,
        description="the most stdout or stderr an exec answer may keep (per stream)",
    )

    # ---- files -------------------------------------------------------------------------------
    files_max_upload_bytes: int = Field(
        default=16 * 1024**3,
        ge=0,
        le=1024**5,
        description="the largest upload (a file, or a directory's tar stream) (413)",
    )
    files_max_transfers_per_instance: int = Field(
        default=4, ge=1, le=10_000, description="file transfers at once on one instance (429)"
    )

    # ---- ports --------------------------------------------------------------------------------
    ports_max_streams_per_instance: int = Field(
        default=32,
        ge=1,
        le=10_000,
        description="port streams (proxied requests, WebSockets, tunnels) at once on one "
        "instance (429)",
    )

    # ---- egress proxy -----------------------------------------------------------------------
    egress_hosts_file: Path | None = Field(
        default=None,
        description="resolve egress destinations from this hosts(5)-format file only "
        "(never DNS); unset: the host's resolver",
    )
    egress_upstream_ca_file: Path | None = Field(
        default=None,
        description="PEM CAs the egress proxy trusts for upstream servers of brokered "
        "credentials, in addition to the host's trust store (tests: a test CA); verification "
        "is never off",
    )

    # ---- sessions ---------------------------------------------------------------------------
    session_ring_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=1024**3)
    session_max_observers: int = Field(default=100, ge=0, le=10_000)
    session_max_per_instance: int = Field(default=64, ge=1, le=10_000)
    session_client_max_lag_bytes: int = Field(
        default=2 * 1024 * 1024,
        ge=64 * 1024,
        le=1024**3,
        description="a client further behind than this is skipped ahead to a snapshot (resync)",
    )
    session_client_stall_seconds: float = Field(
        default=30.0, ge=0.5, le=3600, description="a client stuck in one send this long is dropped"
    )
    session_frame_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    session_open_timeout_seconds: float = Field(default=15.0, ge=0.5, le=600)
    session_kill_grace_seconds: float = Field(default=3.0, ge=0, le=600)
    session_retain_seconds: float = Field(
        default=300.0, ge=0, le=7 * 86400, description="ended sessions stay attachable this long"
    )
    session_recording: bool = True
    session_recording_input: bool = False
    session_recording_max_bytes: int = Field(default=512 * 1024 * 1024, ge=0)
    session_hitl_quiet_ms: int = Field(default=300, ge=10, le=60_000)

    # ---- tasks (A2A surface and the deprecated v1 task API) --------------------------------
    task_max_running: int = Field(
        default=32, ge=1, le=100_000, description="concurrent task runs, all owners together"
    )
    task_max_running_per_owner: int = Field(default=8, ge=1, le=100_000)
    task_max_pending: int = Field(
        default=1000, ge=0, le=1_000_000, description="queued (submitted) tasks before refusal"
    )
    task_max_pending_per_owner: int = Field(default=200, ge=0, le=1_000_000)
    task_cancel_grace_seconds: float = Field(
        default=5.0, ge=0, le=600, description="TERM, then KILL after this long"
    )
    task_recovery_grace_seconds: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="after a restart, how long a running task waits for its agent to come back",
    )
    task_blocking_timeout_seconds: float = Field(
        default=600.0, ge=1, le=86_400, description="longest a blocking SendMessage waits"
    )
    task_output_max_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="output kept in a task's artifact"
    )
    task_output_flush_seconds: float = Field(default=0.25, ge=0, le=10)
    task_files_root: str = Field(
        default="/tmp/a2a-tasks",
        pattern=r"^/[^\x00]*[^/]$",
        max_length=1024,
        description="on the instance: each task's working directory (file parts, outbox)",
    )
    task_file_max_bytes: int = Field(
        default=8 * 1024 * 1024, ge=0, le=1024**3, description="largest incoming A2A file part"
    )
    task_file_inline_bytes: int = Field(
        default=256 * 1024,
        ge=0,
        le=64 * 1024 * 1024,
        description="outbox files up to this size come back as raw bytes (larger: a URL)",
    )
    push_max_attempts: int = Field(default=5, ge=1, le=50)
    push_backoff_initial_seconds: float = Field(default=0.5, ge=0.01, le=600)
    push_backoff_max_seconds: float = Field(default=30.0, ge=0.01, le=3600)
    push_timeout_seconds: float = Field(default=10.0, ge=0.1, le=300)
    push_allow_networks: list[str] = Field(
        default_factory=list,
        description="networks (CIDR, or single addresses) push notifications may reach although "
        "they are not public: loopback, private, link-local … are refused otherwise",
    )
    a2a_card_max_age_seconds: int = Field(default=300, ge=0, le=86_400)
    v1_sunset: dt.date = Field(
        default=dt.date(2027, 6, 30), description="Sunset date announced by the v1 task API"
    )

    @field_validator(
        "http_listen", "grpc_listen", "metrics_listen", "grpc_enroll_listen", "guest_link_listen"
    )
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("push_allow_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item.strip(), strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP network (CIDR) or address") from None
        return value

    @field_validator("guest_link_addresses")
    @classmethod
    def _guest_link_addresses(cls, value: list[str]) -> list[str]:
        out: list[str] = []
        for item in value:
            try:
                addr = ipaddress.ip_address(item.strip())
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address (IPv4 or IPv6 literal)") from None
            if addr.is_unspecified or addr.is_multicast:
                raise ValueError(f"{item!r}: name one address (not unspecified or multicast)")
            if str(addr) not in out:
                out.append(str(addr))
        return out

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        upper = value.upper()
        if upper not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
        return upper

    @field_validator("database_url")
    @classmethod
    def _db_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError("must start with sqlite+aiosqlite:// or postgresql+asyncpg://")
        return value

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        assert value is not None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _absolute_paths(self) -> Settings:
        if not self.data_dir.is_absolute():
            raise ValueError("data_dir must be an absolute path")
        return self

    # ---- derived values -------------------------------------------------------------------
    @property
    def http_address(self) -> tuple[str, int]:
        return parse_listen(self.http_listen)

    @property
    def grpc_address(self) -> tuple[str, int]:
        return parse_listen(self.grpc_listen)

    @property
    def grpc_enroll_address(self) -> tuple[str, int]:
        return parse_listen(self.grpc_enroll_listen)

    @property
    def guest_link_address(self) -> tuple[str, int]:
        return parse_listen(self.guest_link_listen)

    @property
    def guest_link_hosts(self) -> list[str]:
        """Every address the guest link gateway binds: guest_link_listen's, then the others."""
        first = self.guest_link_address[0]
        return [first, *(a for a in self.guest_link_addresses if a != first)]

    def guest_link_reaches(self, address: str) -> bool:
        """Whether the gateway listens where ``address`` (an IP literal) connects."""
        hosts = self.guest_link_hosts
        if hosts[0] in ("", "::") or (hosts[0] == "0.0.0.0" and ":" not in address):
            return True
        return str(ipaddress.ip_address(address)) in hosts

    @property
    def metrics_address(self) -> tuple[str, int]:
        return parse_listen(self.metrics_listen)

    @property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'sandbox.db'}"

    @property
    def effective_public_url(self) -> str:
        if self.public_url:
            return self.public_url
        host, port = self.http_address
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    @property
    def effective_admin_token_file(self) -> Path:
        return self.admin_token_file or self.data_dir / "admin-token"

    @property
    def effective_images_dir(self) -> Path:
        return self.images_dir or self.data_dir / "images"

    @property
    def effective_loadouts_dir(self) -> Path:
        return self.loadouts_dir or self.data_dir / "loadouts"

    @property
    def libvirt_enabled(self) -> bool:
        return bool(self.libvirt_uri)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment wins over the file (passed as init kwargs by load_settings).
        return (env_settings, init_settings)


def _format_validation_error(exc: ValidationError, origin: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        where = origin.get(key, "")
        lines.append(f"{key}{where}: {err['msg']}")
    return "invalid configuration: " + "; ".join(lines)


def load_settings(config_file: Path | None = None) -> Settings:
    """Build Settings from an optional TOML file and `SANDBOX_*` variables.

    Raises ConfigError naming the bad key for unknown keys, unreadable files or invalid values.
    """
    env = os.environ
    known = set(Settings.model_fields)
    origin: dict[str, str] = {}

    unknown_env = sorted(
        k for k in env if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() not in known
    )
    # A few variables belong to tools around the server, not to it.
    unknown_env = [k for k in unknown_env if k not in _NOT_SERVER_SETTINGS]
    if unknown_env:
        raise ConfigError(
            f"unknown setting {unknown_env[0]} (environment); known settings: "
            + ", ".join(ENV_PREFIX + k.upper() for k in sorted(known))
        )

    file_values: dict[str, Any] = {}
    if config_file is not None:
        try:
            file_values = tomllib.loads(config_file.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from None
        for key in file_values:
            if key not in known:
                raise ConfigError(f"unknown setting {key!r} in {config_file}")
            origin[key] = f" (in {config_file})"
    for key in known:
        if ENV_PREFIX + key.upper() in env:
            origin[key] = f" (environment {ENV_PREFIX}{key.upper()})"

    try:
        return Settings(**file_values)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None


# SANDBOX_* variables read by scripts and tests rather than by the server itself.
_NOT_SERVER_SETTINGS = frozenset(
    {
        "SANDBOX_TEST_CACHE",
        "SANDBOX_TEST_POSTGRES_URL",
        "SANDBOX_SKIP_TIERS",
        "SANDBOX_URL",
        "SANDBOX_TOKEN",
        "SANDBOX_CONTEXT",
        "SANDBOX_CONFIG",
    }
)
