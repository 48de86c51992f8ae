"""agent-client configuration: a TOML file (`--config`) and command-line flags (flags win).

server = "127.0.0.1:8120"           # the mutual-TLS agent link (Connect, Renew), host agents;
                                    # several control hosts: "a:8120,b:8120" (controls.py)
enroll_server = "127.0.0.1:8121"    # server-auth TLS listener for Enroll, one per server in the
                                    # same order (default: each server's host, port 8121)
gateway = "10.0.2.2:8124"           # in guests: the guest link gateway through the forward
                                    # (then server and enroll_server are not used)
serial_port = "/dev/virtio-ports/org.agentic-sandbox.link"   # in guests: the same gateway over
                                    # a virtio-serial port, used instead when the machine has it
server_name = "agentic-sandbox-server"
instance_id = "web-1"
ca_cert = "/etc/agentic-sandbox/ca.crt"
enrollment_token_file = "/etc/agentic-sandbox/enrollment-token"   # or enrollment_token
state_dir = "/var/lib/agentic-sandbox-agent"                      # key (0600) + certificate
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agentic_sandbox.agent.controls import ControlAddress

INSTANCE_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
DEFAULT_SERVER = "10.0.2.2:8120"
DEFAULT_SERVER_NAME = "agentic-sandbox-server"
DEFAULT_ENROLL_PORT = 8121
DEFAULT_SERIAL_PORT = "/dev/virtio-ports/org.agentic-sandbox.link"


class ConfigError(Exception):
    pass


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/agentic-sandbox-agent")
    return Path.home() / ".local" / "state" / "agentic-sandbox-agent"


@dataclass
class AgentConfig:
    instance_id: str = ""
    server: str = DEFAULT_SERVER
    enroll_server: str = ""
    gateway: str = ""  # HOST:PORT of the guest link gateway (guests); "" dials server directly
    # the virtio-serial port to the same gateway (serial_link.py), preferred to the forward when
    # the device exists; "" = the forward only
    serial_port: str = DEFAULT_SERIAL_PORT
    # set while the agent runs: the loopback address of its bridge to `serial_port` (not read
    # from a file, never written to one)
    bridge: str = field(default="", repr=False)
    server_name: str = DEFAULT_SERVER_NAME
    ca_cert: Path | None = None
    enrollment_token: str = field(default="", repr=False)
    enrollment_token_file: Path | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    ring_bytes: int = 4 * 1024 * 1024
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    max_sessions: int = 64
    max_streams: int = 64  # byte streams (exec runs, …) at once on the link
    default_user: str = ""
    # HOST:PORT of the guest-local egress proxy listener (allowlist guests); "" = none
    egress_listen: str = ""
    # where the egress proxy's CA (sent over the link at each registration) is written, and the
    # OpenSSL bundle it is spliced into (allowlist guests: /etc/ssl/certs/ca-certificates.crt);
    # "" = this agent accepts no CA (host agents)
    egress_ca_file: str = ""
    egress_ca_bundle: str = ""
    log_level: str = "INFO"
    log_format: str = "json"
    # In a guest: take the identity from the cloud-init seed and follow it when it changes
    # (a clone restored from another guest's memory). Off for host-side agents.
    seed_identity: bool = False
    # Run the agent under the session keeper (keeper.py): sessions outlive a worker restart.
    session_keeper: bool = True
    config_path: Path | None = field(default=None, repr=False)  # where this config came from

    def validate(self) -> AgentConfig:
        if not INSTANCE_RE.match(self.instance_id):
            raise ConfigError("instance_id: required, [a-z0-9][a-z0-9-]{0,62}")
        for key in ("server", "enroll_server", "gateway", "egress_listen"):
            value = getattr(self, key)
            if key in ("gateway", "egress_listen") and not value:
                continue
            items = _split(value) if key in ("server", "enroll_server") else [value]
            if not items:
                raise ConfigError(f"{key}: expected HOST:PORT, got {value!r}")
            for item in items:
                host, sep, port = item.rpartition(":")
                if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ConfigError(f"{key}: expected HOST:PORT, got {item!r}")
        if len(_split(self.enroll_server)) != len(_split(self.server)):
            raise ConfigError(
                f"enroll_server: one address per server ({len(_split(self.server))}), "
                f"got {self.enroll_server!r}"
            )
        if self.serial_port and not self.serial_port.startswith("/"):
            raise ConfigError(f'serial_port: an absolute path or "", got {self.serial_port!r}')
        if self.egress_ca_file and not self.egress_ca_file.startswith("/"):
            raise ConfigError(f"egress_ca_file: an absolute path, got {self.egress_ca_file!r}")
        if self.egress_ca_bundle and not self.egress_ca_bundle.startswith("/"):
            raise ConfigError(f"egress_ca_bundle: an absolute path, got {self.egress_ca_bundle!r}")
        if self.egress_ca_bundle and not self.egress_ca_file:
            raise ConfigError("egress_ca_bundle: needs egress_ca_file")
        if not 4096 <= self.ring_bytes <= 1024**3:
            raise ConfigError("ring_bytes: between 4096 and 1 GiB")
        if not 0.01 <= self.initial_backoff <= self.max_backoff <= 3600:
            raise ConfigError("initial_backoff <= max_backoff, within 0.01..3600 s")
        if not 1 <= self.max_sessions <= 10_000:
            raise ConfigError("max_sessions: between 1 and 10000")
        if not 1 <= self.max_streams <= 10_000:
            raise ConfigError("max_streams: between 1 and 10000")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError("log_level: DEBUG, INFO, WARNING or ERROR")
        if self.log_format not in ("json", "text"):
            raise ConfigError("log_format: json or text")
        return self

    @property
    def route(self) -> str:
        """HOST:PORT a guest's agent dials as its gateway: its port bridge, else the forward."""
        return self.bridge or self.gateway

    def control_addresses(self) -> list[ControlAddress]:
        """Every control host's (link, enrollment) address, in the configured order."""
        return [
            ControlAddress(link, enroll)
            for link, enroll in zip(_split(self.server), _split(self.enroll_server), strict=True)
        ]

    def token(self) -> str:
        """The enrollment token (read from its file each time: an operator may replace it)."""
        if self.enrollment_token:
            return self.enrollment_token.strip()
        if self.enrollment_token_file is not None:
            try:
                return self.enrollment_token_file.read_text().strip()
            except OSError:
                return ""
        return ""

    def to_toml(self) -> str:
        """This configuration as TOML (for rewriting the file after an identity change)."""
        import json

        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("config_path", "enrollment_token", "bridge") or value is None:
                continue
            if value == "" and f.name != "serial_port":  # "" there turns the port off
                continue
            if isinstance(value, bool):
                lines.append(f"{f.name} = {'true' if value else 'false'}")
            elif isinstance(value, int | float):
                lines.append(f"{f.name} = {value}")
            else:
                lines.append(f"{f.name} = {json.dumps(str(value))}")
        return "\n".join(lines) + "\n"

    # state files
    @property
    def key_path(self) -> Path:
        return self.state_dir / "agent.key"

    @property
    def cert_path(self) -> Path:
        return self.state_dir / "agent.crt"

    @property
    def ca_path(self) -> Path:
        return self.state_dir / "ca.crt"

    @property
    def cert_meta_path(self) -> Path:
        return self.state_dir / "cert.json"


def _split(value: str) -> list[str]:
    """A comma-separated list of addresses (a TOML list is joined before it gets here)."""
    return [item.strip() for item in value.split(",") if item.strip()]


def default_enroll(servers: str) -> str:
    """Each server's host with the enrollment port (8121)."""
    return ",".join(f"{s.rpartition(':')[0]}:{DEFAULT_ENROLL_PORT}" for s in _split(servers))


_PATHS = {"ca_cert", "enrollment_token_file", "state_dir", "config_path"}
_BOOLS = {"seed_identity", "session_keeper"}
_FLOATS = {"initial_backoff", "max_backoff"}
_INTS = {"ring_bytes", "max_sessions", "max_streams"}
_LISTS = {"server", "enroll_server"}  # TOML may give either as a list


def _coerce(key: str, value: Any) -> Any:
    if key in _LISTS and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if key in _PATHS:
        return Path(str(value)) if value not in (None, "") else None
    if key in _FLOATS:
        return float(value)
    if key in _INTS:
        return int(value)
    if key in _BOOLS:
        if isinstance(value, bool):
            return value
        return str(value).lower() in ("1", "true", "yes", "on")
    return str(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agent-client",
        description="agentic-sandbox agent: one gRPC (mutual TLS) link to the management "
        "server, PTY sessions and task runs for this instance.",
    )
    p.add_argument("--config", type=Path, help="TOML file (flags override it)")
    p.add_argument("--instance-id", help="this instance's id")
    p.add_argument(
        "--server",
        help=f"agent link HOST:PORT (default {DEFAULT_SERVER}); several control hosts: "
        "comma-separated, the agent follows the leader among them",
    )
    p.add_argument(
        "--enroll-server",
        help="enrollment HOST:PORT, one per --server (default: each server's host, port 8121)",
    )
    p.add_argument(
        "--gateway", help="HOST:PORT of the guest link gateway (in guests, through the forward)"
    )
    p.add_argument("--server-name", help=f"TLS name to verify (default {DEFAULT_SERVER_NAME})")
    p.add_argument("--ca-cert", help="CA certificate (PEM) that signed the server")
    p.add_argument("--enrollment-token", help="one-time enrollment token (prefer the file)")
    p.add_argument("--enrollment-token-file", help="file holding the enrollment token")
    p.add_argument("--state-dir", help="where the key (0600) and certificate live")
    p.add_argument("--ring-bytes", type=int, help="per-session output ring (default 4 MiB)")
    p.add_argument("--initial-backoff", type=float, help="first reconnect delay (default 0.5 s)")
    p.add_argument("--max-backoff", type=float, help="longest reconnect delay (default 30 s)")
    p.add_argument("--max-sessions", type=int, help="sessions at once (default 64)")
    p.add_argument("--max-streams", type=int, help="exec runs and other streams at once (64)")
    p.add_argument(
        "--egress-listen", help="HOST:PORT of a local egress proxy listener (allowlist guests)"
    )
    p.add_argument(
        "--egress-ca-file", help="write the egress proxy's CA here when the server sends it"
    )
    p.add_argument(
        "--egress-ca-refresh", help="command run after the CA is written (update-ca-certificates)"
    )
    p.add_argument("--default-user", help="user for sessions that name none (default: agent's)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", choices=("json", "text"))
    p.add_argument(
        "--no-session-keeper",
        dest="session_keeper",
        action="store_const",
        const=False,
        help="run without the session keeper (sessions end when the agent process does)",
    )
    p.add_argument(
        "--seed-identity",
        action="store_const",
        const=True,
        help="follow the identity on the cloud-init seed (in guests)",
    )
    return p


def load(args: argparse.Namespace) -> AgentConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        try:
            data = tomllib.loads(args.config.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read {args.config}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{args.config} is not valid TOML: {exc}") from None
        known = {f.name for f in fields(AgentConfig)} - {"config_path", "bridge"}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"unknown setting {key!r} in {args.config}")
            values[key] = value
    for f in fields(AgentConfig):
        flag = getattr(args, f.name, None)
        if flag is not None:
            values[f.name] = flag
    if args.config is not None:
        values["config_path"] = args.config
    try:
        cfg = AgentConfig(**{k: _coerce(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if not cfg.enroll_server:
        cfg.enroll_server = default_enroll(cfg.server)
    return cfg.validate()
