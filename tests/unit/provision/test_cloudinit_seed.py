"""cloud-init documents and the NoCloud seed ISO."""

from __future__ import annotations

import io
import json
import tarfile
import tomllib
from pathlib import Path

import yaml

from provision import load_catalog, read_seed_iso, write_seed_iso
from provision.cloudinit import (
    AGENT_CONFIG,
    AgentBootstrap,
    agent_bundle,
    render_meta_data,
    render_network_config,
    render_user_data,
)
from provision.seed import SeedFiles

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHx0 op@example"


def bootstrap() -> AgentBootstrap:
    return AgentBootstrap(
        instance_id="vm-1",
        server_address="10.0.2.2:8120",
        enroll_address="10.0.2.2:8121",
        server_name="agentic-sandbox-server",
        enrollment_token="sbe_secret",
        ca_pem="-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n",
        bundle=agent_bundle(),
    )


def test_user_data_installs_and_configures_the_agent() -> None:
    lo = load_catalog().resolve("dev")
    text = render_user_data(
        hostname="vm-1", loadout=lo, bootstrap=bootstrap(), ssh_keys=[KEY], nat=True
    )
    assert text.startswith("#cloud-config\n")
    doc = yaml.safe_load(text)
    files = {f["path"]: f for f in doc["write_files"]}
    cfg = tomllib.loads(files[AGENT_CONFIG]["content"])
    assert cfg["instance_id"] == "vm-1" and cfg["enroll_server"] == "10.0.2.2:8121"
    assert files["/etc/agentic-sandbox/enrollment-token"]["permissions"] == "0600"
    unit = files["/etc/systemd/system/agentic-sandbox-agent.service"]["content"]
    assert "Restart=on-failure" in unit and "StartLimitBurst=" in unit
    assert files["/etc/resolv.conf"]["content"] == "nameserver 10.0.2.3\n"
    user = doc["users"][0]
    assert user["name"] == "agent" and user["ssh_authorized_keys"] == [KEY]
    assert user["sudo"] == "ALL=(ALL) NOPASSWD:ALL"  # dev has sudo
    assert doc["packages"] == lo.packages
    assert ["systemctl", "enable", "--now", "agentic-sandbox-agent.service"] in doc["runcmd"]
    assert files["/home/agent/.tmux.conf"]["owner"] == "agent:agent"


def test_the_bundle_holds_the_agent_and_proto_packages() -> None:
    with tarfile.open(fileobj=io.BytesIO(agent_bundle())) as tar:
        names = set(tar.getnames())
    assert "agent/__init__.py" in names and "proto/agent_pb2.py" in names
    assert not any(n.startswith(("broker/", "fleet/")) for n in names)
    assert agent_bundle() == agent_bundle()  # reproducible


def test_minimal_loadout_has_no_sudo_and_no_packages() -> None:
    lo = load_catalog().resolve("minimal")
    doc = yaml.safe_load(
        render_user_data(hostname="h", loadout=lo, bootstrap=bootstrap(), ssh_keys=[])
    )
    assert "sudo" not in doc["users"][0] and "packages" not in doc


def test_network_config_static_has_no_route_and_no_dns() -> None:
    static = yaml.safe_load(render_network_config("static"))
    eth = static["ethernets"]["eth0"]
    assert eth["addresses"] == ["10.0.2.15/24"] and eth["dhcp4"] is False
    assert "routes" not in eth and "gateway4" not in eth and "nameservers" not in eth
    assert yaml.safe_load(render_network_config("dhcp"))["ethernets"]["eth0"]["dhcp4"] is True
    assert yaml.safe_load(render_meta_data("vm-1", "vm-1")) == {
        "instance-id": "vm-1",
        "local-hostname": "vm-1",
    }


def test_seed_iso_has_cidata_label_and_cloud_init_names(tmp_path: Path) -> None:
    seed = SeedFiles(
        "#cloud-config\n{}\n",
        "instance-id: a\n",
        "version: 2\n",
        extra={"agentic-sandbox.json": json.dumps({"instance_id": "a"})},
    )
    path = write_seed_iso(tmp_path / "s.iso", seed)
    files = read_seed_iso(path)
    assert files[".volume_id"] == b"cidata"
    assert files["user-data"].startswith(b"#cloud-config")
    assert json.loads(files["agentic-sandbox.json"]) == {"instance_id": "a"}
    assert oct(path.stat().st_mode & 0o777) == "0o644"
