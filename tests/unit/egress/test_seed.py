"""An `allowlist` guest's seed: the agent's proxy listener and every tool's proxy settings;
other guests get none of it."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any, cast

import yaml

from agentic_sandbox.fleet import EgressPolicy, Fleet
from agentic_sandbox.provision import load_catalog
from agentic_sandbox.provision.cloudinit import AGENT_CONFIG
from agentic_sandbox.provision.pipeline import Provisioner, ProvisionRequest

URL = "http://127.0.0.1:3128"


def files_for(network: EgressPolicy, tmp: Path) -> dict[str, dict[str, Any]]:
    prov = Provisioner(cast(Fleet, object()), tmp)
    req = ProvisionRequest(
        instance_id="vm-1", owner="op", loadout=load_catalog().resolve("minimal"), network=network
    )
    doc = yaml.safe_load(prov.seed_files(req, None).user_data)
    return {f["path"]: f for f in doc["write_files"]}


def test_allowlist_guests_point_every_tool_at_the_agents_listener(tmp_path: Path) -> None:
    files = files_for(EgressPolicy.ALLOWLIST, tmp_path)
    config = tomllib.loads(files[AGENT_CONFIG]["content"])
    assert config["egress_listen"] == "127.0.0.1:3128"
    # the egress CA comes over the link at each registration; the seed says where it goes
    assert config["egress_ca_file"] == "/usr/local/share/ca-certificates/agentic-sandbox-egress.crt"
    assert config["egress_ca_bundle"] == "/etc/ssl/certs/ca-certificates.crt"
    assert not any("ca-certificates" in path for path in files)
    env = files["/etc/environment"]
    assert env["append"] is True
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        assert f"{var}={URL}\n" in env["content"]
    assert "no_proxy=localhost,127.0.0.1,::1\n" in env["content"]
    profile = files["/etc/profile.d/egress-proxy.sh"]["content"]
    assert f'export https_proxy="${{https_proxy:-{URL}}}"\n' in profile  # a login keeps its own
    shown = subprocess.run(
        ["sh", "-c", ". /dev/stdin; echo $https_proxy", "sh"],
        input=profile,
        capture_output=True,
        text=True,
        env={"https_proxy": "http://run-t@127.0.0.1:3128"},
        check=True,
    )
    assert shown.stdout == "http://run-t@127.0.0.1:3128\n"
    unset = subprocess.run(
        ["sh", "-c", ". /dev/stdin; echo $https_proxy"],
        input=profile,
        capture_output=True,
        text=True,
        env={},
        check=True,
    )
    assert unset.stdout == f"{URL}\n"
    agent_env = files["/etc/agentic-sandbox/environment"]["content"]  # sessions and tasks
    assert f'http_proxy="{URL}"\n' in agent_env
    apt = files["/etc/apt/apt.conf.d/80egress-proxy"]["content"]
    assert f'Acquire::http::Proxy "{URL}";' in apt and f'Acquire::https::Proxy "{URL}";' in apt
    assert files["/etc/pip.conf"]["content"] == f"[global]\nproxy = {URL}\n"
    assert f"https-proxy={URL}\n" in files["/etc/npmrc"]["content"]
    assert f"[http]\n\tproxy = {URL}\n" in files["/etc/gitconfig"]["content"]


def test_other_guests_get_no_proxy(tmp_path: Path) -> None:
    for network in (EgressPolicy.ISOLATED, EgressPolicy.NAT):
        files = files_for(network, tmp_path)
        config = tomllib.loads(files[AGENT_CONFIG]["content"])
        assert "egress_listen" not in config and "egress_ca_file" not in config
        assert not {"/etc/environment", "/etc/pip.conf", "/etc/gitconfig"} & set(files)
