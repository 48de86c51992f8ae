"""cloud-init NoCloud documents for one instance: user-data, meta-data and network-config.

The user-data installs the current agent-client (the agent bundle of `provision.bundle`,
base64 in `write_files`), writes its configuration, creates the `agent` user with the
operator's SSH keys (and sudo per loadout), applies the loadout (packages, files, environment,
commands), and enables a systemd unit that restarts the agent on failure, with a limit. Progress
is printed to the serial console as `agentic-sandbox: stage <name>` lines.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from agentic_sandbox.provision.agent_console import AGENT_IDENTIFIER
from agentic_sandbox.provision.loadouts import Loadout

AGENT_HOME = "/opt/agentic-sandbox"
AGENT_APP = f"{AGENT_HOME}/app"
AGENT_VENV = f"{AGENT_HOME}/venv"
AGENT_ETC = "/etc/agentic-sandbox"
AGENT_CONFIG = f"{AGENT_ETC}/agent.toml"
AGENT_UNIT = "agentic-sandbox-agent.service"
AGENT_INSTALL = "/usr/local/sbin/agentic-sandbox-install-agent"
GUEST_ADDRESS = "10.0.2.15/24"  # QEMU user-mode networking's guest address
HOST_ALIAS = "10.0.2.2"  # QEMU user-mode networking's alias for the host's loopback
RUNTIME_REQUIREMENTS = ("grpcio", "protobuf", "ptyprocess")
MARKER = "agentic-sandbox: stage"


class _CloudConfigDumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the seed reads like the files it writes."""


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_CloudConfigDumper.add_representer(str, _str_presenter)


@dataclass(frozen=True)
class AgentBootstrap:
    """What the guest needs to run and enroll its agent."""

    instance_id: str
    gateway_address: str  # the guest link gateway as the guest sees it, e.g. 10.0.2.2:8124
    server_name: str  # the TLS name the agent verifies
    enrollment_token: str
    ca_pem: str
    bundle: bytes = field(repr=False)
    runtime_baked: bool = True  # False for user-supplied cloud images: pip installs it
    extra_config: dict[str, Any] = field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "gateway": self.gateway_address,
            "server_name": self.server_name,
            "ca_cert": f"{AGENT_ETC}/ca.pem",
            "enrollment_token_file": f"{AGENT_ETC}/enrollment-token",
            "state_dir": "/var/lib/agentic-sandbox-agent",
            "seed_identity": True,
            "log_format": "text",
            "default_user": "agent",  # sessions that name no user are the agent user's
            **self.extra_config,
        }

    def config_toml(self) -> str:
        """The agent's TOML config (JSON string escapes are valid TOML basic strings)."""
        lines = []
        for key, value in self.config().items():
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int | float):
                lines.append(f"{key} = {value}")
            else:
                lines.append(f"{key} = {json.dumps(str(value))}")
        return "\n".join(lines) + "\n"


def _stage(name: str) -> list[str]:
    return ["sh", "-c", f"echo '{MARKER} {name}' > /dev/ttyS0 2>/dev/null || true"]


def agent_install_script(runtime_baked: bool) -> str:
    """Unpack the agent bundle and start the agent, once per instance. Whichever of its two
    callers comes first does the work (the early start after cloud-init's network stage, or
    `runcmd` at the end of cloud-init); a lock keeps them from overlapping."""
    venv = (
        ""
        if runtime_baked
        else f"""  stage agent-runtime
  python3 -m venv {AGENT_VENV}
  {AGENT_VENV}/bin/pip install --quiet {" ".join(RUNTIME_REQUIREMENTS)}
"""
    )
    return f"""#!/bin/sh
# agentic-sandbox: unpack the agent bundle and start the agent (once per instance).
set -eu
exec 9>/run/agentic-sandbox-install-agent.lock
flock 9
stage() {{ echo "{MARKER} $1" >> /dev/ttyS0 2>/dev/null || true; }}
if [ ! -e {AGENT_APP}/.installed ]; then
  stage agent-install
  mkdir -p {AGENT_APP}
  tar -xzf {AGENT_HOME}/agent-bundle.tar.gz -C {AGENT_APP}
  sha256sum {AGENT_HOME}/agent-bundle.tar.gz | cut -d' ' -f1 > {AGENT_APP}/.bundle-digest
{venv}  # start first (systemd loads a unit it has not seen on demand; no reload), enable after
  systemctl start {AGENT_UNIT} || {{ systemctl daemon-reload && systemctl start {AGENT_UNIT}; }}
  systemctl enable --quiet --no-reload {AGENT_UNIT}
  touch {AGENT_APP}/.installed
  stage agent-started
fi
"""


def agent_unit(python: str) -> str:
    return f"""[Unit]
Description=agentic-sandbox agent (PTY sessions and tasks for the management server)
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=300
StartLimitBurst=20

[Service]
Type=simple
Environment=PYTHONPATH={AGENT_APP}
Environment=PYTHONDONTWRITEBYTECODE=1
ExecStart={python} -m agentic_sandbox.agent --config {AGENT_CONFIG}
Restart=on-failure
RestartSec=2
# The agent's cgroup is its own: each exec run gets a child cgroup with its budget (memory,
# pids, cpu) under it (agent/cgroups.py), and stopping the unit ends every run with it.
Delegate=yes
# Its log also goes to the serial console, under its own name: the server watches it while
# the agent enrolls (an agent that dies at start fails the provision at once) and shows its
# tail when enrolment stalls.
StandardOutput=journal+console
StandardError=journal+console
SyslogIdentifier={AGENT_IDENTIFIER}

[Install]
WantedBy=multi-user.target
"""


EGRESS_LISTEN = "127.0.0.1:3128"  # the agent's proxy listener in `allowlist` guests
NO_PROXY = "localhost,127.0.0.1,::1"
# The egress proxy's CA (per incarnation; sent over the agent link at each registration, since
# a clone or a pool member boots from another guest's memory and a server restart makes a new
# one): where the agent writes it, and the bundle OpenSSL reads that it is spliced into.
EGRESS_CA_FILE = "/usr/local/share/ca-certificates/agentic-sandbox-egress.crt"
EGRESS_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def egress_agent_config() -> dict[str, str]:
    """The agent settings of an `allowlist` guest: its proxy listener and the CA's place."""
    return {
        "egress_listen": EGRESS_LISTEN,
        "egress_ca_file": EGRESS_CA_FILE,
        "egress_ca_bundle": EGRESS_CA_BUNDLE,
    }


def proxy_environment(url: str) -> dict[str, str]:
    """The proxy variables every tool reads (both spellings: curl wants lower case)."""
    env = {"http_proxy": url, "https_proxy": url, "no_proxy": NO_PROXY}
    return {**env, **{k.upper(): v for k, v in env.items()}}


def proxy_files(url: str) -> list[dict[str, Any]]:
    """An `allowlist` guest's proxy settings: the environment for logins (the agent gives its
    sessions and execs the same from its `egress_listen`), and apt's, pip's, npm's and git's."""
    env = "".join(f"{k}={v}\n" for k, v in sorted(proxy_environment(url).items()))
    # a login shell keeps the proxy it was given (an exec's carries its egress token)
    profile = "".join(
        f'export {k}="${{{k}:-{v}}}"\n' for k, v in sorted(proxy_environment(url).items())
    )
    return [
        {"path": "/etc/environment", "content": env, "append": True, "permissions": "0644"},
        {"path": "/etc/profile.d/egress-proxy.sh", "content": profile, "permissions": "0644"},
        {
            "path": "/etc/apt/apt.conf.d/80egress-proxy",
            "content": f'Acquire::http::Proxy "{url}";\nAcquire::https::Proxy "{url}";\n',
            "permissions": "0644",
        },
        {"path": "/etc/pip.conf", "content": f"[global]\nproxy = {url}\n", "permissions": "0644"},
        {
            "path": "/etc/npmrc",
            "content": f"proxy={url}\nhttps-proxy={url}\nnoproxy={NO_PROXY}\n",
            "permissions": "0644",
        },
        {
            "path": "/etc/gitconfig",
            "content": f"[http]\n\tproxy = {url}\n[https]\n\tproxy = {url}\n",
            "permissions": "0644",
        },
    ]


def render_user_data(
    *,
    hostname: str,
    loadout: Loadout,
    bootstrap: AgentBootstrap,
    ssh_keys: list[str],
    python: str = f"{AGENT_VENV}/bin/python",
    elide_bundle: bool = False,
    nat: bool = False,
    egress_proxy: str | None = None,
) -> str:
    """The #cloud-config document (`elide_bundle` shows the agent bundle as a placeholder, for
    dry runs that print it)."""
    bundle_b64 = (
        f"<agent bundle: {len(bootstrap.bundle)} bytes, base64>"
        if elide_bundle
        else base64.b64encode(bootstrap.bundle).decode()
    )
    write_files: list[dict[str, Any]] = [
        {
            "path": f"{AGENT_HOME}/agent-bundle.tar.gz",
            "encoding": "b64",
            "content": bundle_b64,
            "permissions": "0644",
        },
        {
            "path": AGENT_CONFIG,
            "content": bootstrap.config_toml(),
            "permissions": "0644",
        },
        {"path": f"{AGENT_ETC}/ca.pem", "content": bootstrap.ca_pem, "permissions": "0644"},
        {
            "path": f"{AGENT_ETC}/enrollment-token",
            "content": bootstrap.enrollment_token + "\n",
            "permissions": "0600",
        },
        {
            "path": f"/etc/systemd/system/{AGENT_UNIT}",
            "content": agent_unit(python),
            "permissions": "0644",
        },
    ]
    if nat:  # the image ships an empty resolv.conf; user-mode NAT's resolver is 10.0.2.3
        write_files.append(
            {"path": "/etc/resolv.conf", "content": "nameserver 10.0.2.3\n", "permissions": "0644"}
        )
    environment = dict(loadout.environment)
    if egress_proxy is not None:
        write_files += proxy_files(egress_proxy)
        environment = {**proxy_environment(egress_proxy), **environment}
    if environment:
        env_lines = "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(environment.items()))
        write_files.append(
            {"path": f"{AGENT_ETC}/environment", "content": env_lines, "permissions": "0644"}
        )
    for wf in loadout.write_files:
        write_files.append(
            {
                "path": wf.path,
                "content": wf.content,
                "permissions": wf.permissions,
                "owner": wf.owner,
                "defer": True,  # after users exist, so agent:agent owners resolve
            }
        )

    user: dict[str, Any] = {
        "name": "agent",
        "gecos": "agentic-sandbox agent",
        "shell": "/bin/bash",
        "lock_passwd": True,
        "ssh_authorized_keys": list(ssh_keys),
        # systemd-journal: the server's diagnosis over SSH reads the agent's journal as `agent`
        "groups": ["systemd-journal", "sudo"] if loadout.sudo else ["systemd-journal"],
    }
    if loadout.sudo:
        user["sudo"] = "ALL=(ALL) NOPASSWD:ALL"

    write_files.append(
        {
            "path": AGENT_INSTALL,
            "content": agent_install_script(bootstrap.runtime_baked),
            "permissions": "0755",
        }
    )
    # The agent starts as soon as cloud-init's network stage has written its files, while
    # cloud-init's config and final stages (about 25 s of a TCG guest's boot) go on beside it —
    # unless the loadout installs packages (they come first) or the runtime is not baked in.
    bootcmd: list[list[str]] = []
    if early_agent_start(loadout, bootstrap.runtime_baked):
        once = ["cloud-init-per", "instance", "agentic-sandbox-agent-early"]
        later = [  # not waited for: cloud-init's network stage is running this very command
            "systemd-run",
            "--no-block",
            "--unit=agentic-sandbox-install-agent",
            "--description=agentic-sandbox: install and start the agent",
            "--property=After=cloud-init.service",
        ]
        bootcmd.append([*once, *later, "/bin/sh", AGENT_INSTALL])
    runcmd: list[list[str]] = [["/bin/sh", AGENT_INSTALL]]
    for cmd in loadout.runcmd:
        runcmd.append(list(cmd))
    runcmd.append(_stage("loadout-applied"))

    doc: dict[str, Any] = {
        "hostname": hostname,
        "fqdn": hostname,
        "manage_etc_hosts": True,
        "locale": "C.UTF-8",
        # no `ssh_pwauth`: the image already refuses password logins (and no account here has
        # a password); setting it makes cloud-init restart sshd during boot
        "disable_root": True,
        "users": [user],
        "write_files": write_files,
        **({"bootcmd": bootcmd} if bootcmd else {}),
        "runcmd": runcmd,
        "final_message": f"{MARKER} cloud-init-done after $UPTIME s",
    }
    if loadout.packages:
        doc["packages"] = list(loadout.packages)
        doc["package_update"] = True
    return "#cloud-config\n" + yaml.dump(
        doc, Dumper=_CloudConfigDumper, sort_keys=False, width=1_000_000
    )


def early_agent_start(loadout: Loadout, runtime_baked: bool) -> bool:
    """Whether the agent may start before cloud-init's last stage: not when the loadout's
    packages (installed in that stage) must come first, nor when the runtime is pip-installed."""
    return runtime_baked and not loadout.packages


def render_meta_data(instance_id: str, hostname: str) -> str:
    return yaml.safe_dump({"instance-id": instance_id, "local-hostname": hostname}, sort_keys=False)


def render_network_config(mode: Literal["static", "dhcp"]) -> str:
    """Static: the user-mode address with no default route and no DNS (the only reachable place
    is the host alias on-link). DHCP: ordinary user-mode NAT.

    Static links also refuse IPv6 router advertisements: no router may hand the guest a route.
    (cloud-init 22.4 renders `accept-ra` only for DHCPv6 links, so the image carries the same
    setting as a networkd drop-in; see `images.rootfs.NO_RA_DROPIN`.)"""
    eth: dict[str, Any] = {"match": {"name": "e*"}}
    if mode == "static":
        eth.update(
            {"addresses": [GUEST_ADDRESS], "dhcp4": False, "dhcp6": False, "accept-ra": False}
        )
    else:
        eth.update({"dhcp4": True})
    return yaml.safe_dump({"version": 2, "ethernets": {"eth0": eth}}, sort_keys=False)
