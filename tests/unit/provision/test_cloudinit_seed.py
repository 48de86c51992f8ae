"""cloud-init documents and the NoCloud seed ISO."""

from __future__ import annotations

import json
import logging
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from agentic_sandbox.agent.identity import SeedIdentity
from agentic_sandbox.proto import seed_record
from agentic_sandbox.provision import load_catalog, read_seed_iso, write_seed_iso
from agentic_sandbox.provision.bundle import build_bundle
from agentic_sandbox.provision.cloudinit import (
    AGENT_CONFIG,
    AGENT_HOME,
    AGENT_INSTALL,
    AGENT_UNIT,
    AgentBootstrap,
    agent_install_script,
    early_agent_start,
    render_meta_data,
    render_network_config,
    render_user_data,
)
from agentic_sandbox.provision.seed import SeedFiles, bind_to_member

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHx0 op@example"


def bootstrap() -> AgentBootstrap:
    return AgentBootstrap(
        instance_id="vm-1",
        gateway_address="10.0.2.2:8124",
        server_name="agentic-sandbox-server",
        enrollment_token="sbe_secret",
        ca_pem="-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n",
        bundle=build_bundle(),
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
    assert cfg["instance_id"] == "vm-1" and cfg["gateway"] == "10.0.2.2:8124"
    assert "server" not in cfg and "enroll_server" not in cfg  # guests dial the gateway
    assert files["/etc/agentic-sandbox/enrollment-token"]["permissions"] == "0600"
    unit = files["/etc/systemd/system/agentic-sandbox-agent.service"]["content"]
    assert "Restart=on-failure" in unit and "StartLimitBurst=" in unit
    assert files["/etc/resolv.conf"]["content"] == "nameserver 10.0.2.3\n"
    user = doc["users"][0]
    assert user["name"] == "agent" and user["ssh_authorized_keys"] == [KEY]
    assert user["sudo"] == "ALL=(ALL) NOPASSWD:ALL"  # dev has sudo
    assert doc["packages"] == lo.packages
    install = files[AGENT_INSTALL]
    assert install["permissions"] == "0755"
    assert "systemctl start agentic-sandbox-agent.service" in install["content"]
    assert doc["runcmd"][0] == ["/bin/sh", AGENT_INSTALL]
    assert "bootcmd" not in doc  # dev installs packages: the agent starts after them
    assert files["/home/agent/.tmux.conf"]["owner"] == "agent:agent"


def test_agent_starts_early_unless_packages_or_a_runtime_come_first() -> None:
    minimal = load_catalog().resolve("minimal")
    doc = yaml.safe_load(
        render_user_data(hostname="vm-1", loadout=minimal, bootstrap=bootstrap(), ssh_keys=[])
    )
    (early,) = doc["bootcmd"]
    # once per instance, not waited for (cloud-init is still running), after its network stage
    assert early[:3] == ["cloud-init-per", "instance", "agentic-sandbox-agent-early"]
    assert "--no-block" in early and "--property=After=cloud-init.service" in early
    assert early[-2:] == ["/bin/sh", AGENT_INSTALL]
    assert doc["runcmd"][0] == ["/bin/sh", AGENT_INSTALL]  # and again at the end: a no-op then
    assert early_agent_start(minimal, runtime_baked=True)
    assert not early_agent_start(minimal, runtime_baked=False)
    assert not early_agent_start(load_catalog().resolve("dev"), runtime_baked=True)


def test_agent_install_script_runs_once_under_a_lock(tmp_path: Path) -> None:
    """Run the real script (its guest paths moved under tmp_path, systemctl recorded): the
    first call unpacks and starts the agent, the second finds it done."""
    script = agent_install_script(runtime_baked=True)
    assert "pip install" not in script and "pip install" in agent_install_script(False)
    assert script.index("flock 9") < script.index("tar -xzf")
    home, bin_dir = tmp_path / "opt", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    (home / "agent-bundle.tar.gz").write_bytes(build_bundle())
    calls = tmp_path / "systemctl.calls"
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "systemctl").chmod(0o755)
    moved = (
        script.replace(AGENT_HOME, str(home))
        .replace("/run/", f"{tmp_path}/")
        .replace("/dev/ttyS0", str(tmp_path / "console"))
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    for _ in range(2):
        res = subprocess.run(["sh", "-c", moved], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    assert (home / "app" / "agentic_sandbox" / "agent" / "runtime.py").exists()
    assert calls.read_text().splitlines() == [
        f"start {AGENT_UNIT}",
        f"enable --quiet --no-reload {AGENT_UNIT}",
    ]
    console = (tmp_path / "console").read_text()
    assert console.count("agent-install") == 1 and console.count("agent-started") == 1


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
    assert eth["accept-ra"] is False  # no IPv6 router either (and no 12 s wait for one)
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
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # it holds a one-time token
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def test_a_hand_off_seed_is_bound_to_its_member_in_the_record_only(tmp_path: Path) -> None:
    """`bind_to_member` adds `standby_of` to the system-area record the agent reads; the ISO's
    files stay as they were (an agent that mounts them makes a fresh key)."""
    identity_json = {"instance_id": "web-1", "enrollment_token": "sbe_x"}
    seed = SeedFiles(
        "#cloud-config\n{}\n",
        "instance-id: web-1\n",
        extra={"agentic-sandbox.json": json.dumps(identity_json)},
        front=json.dumps(identity_json).encode(),
    )
    path = write_seed_iso(tmp_path / "s.iso", seed)
    before = read_seed_iso(path)
    assert bind_to_member(path, "pool-1a2b") is True
    payload = seed_record.unpack(path.read_bytes()[: seed_record.SYSTEM_AREA])
    assert payload is not None
    parsed = SeedIdentity.from_json(json.loads(payload))
    assert parsed.instance_id == "web-1" and parsed.standby_of == "pool-1a2b"
    assert parsed.enrollment_token == "sbe_x"
    assert read_seed_iso(path) == before  # the filesystem is untouched
    assert "standby_of" not in json.loads(before["agentic-sandbox.json"])
    assert bind_to_member(path, "") is True  # taken off again: the seed goes to a clone
    payload = seed_record.unpack(path.read_bytes()[: seed_record.SYSTEM_AREA])
    assert payload is not None and "standby_of" not in json.loads(payload)
    assert SeedIdentity.from_json(json.loads(payload)).standby_of == ""

    bare = write_seed_iso(tmp_path / "bare.iso", SeedFiles("#cloud-config\n{}\n", "x: 1\n"))
    raw = bare.read_bytes()
    assert bind_to_member(bare, "pool-1a2b") is False and bare.read_bytes() == raw


async def test_a_seed_bound_for_a_failed_hand_off_goes_to_the_fallback_clone_unbound(
    tmp_path: Path,
) -> None:
    """`take_from_pool` bound the seed to a member whose hand-off then failed and found no
    other: the clone made instead gets the seed without `standby_of` (no member's key may ever
    serve a clone)."""
    from agentic_sandbox.fleet import CloneSpec, PoolStatus
    from agentic_sandbox.provision import Provisioner, ProvisionRequest

    seed_path = write_seed_iso(
        tmp_path / "web-1.iso",
        SeedFiles("#cloud-config\n{}\n", "x: 1\n", front=b'{"instance_id":"web-1"}'),
    )
    records: list[dict[str, object]] = []

    def record() -> dict[str, object]:
        payload = seed_record.unpack(seed_path.read_bytes()[: seed_record.SYSTEM_AREA])
        assert payload is not None
        return dict(json.loads(payload))

    class Fleet:
        async def take_from_pool(self, key: str, spec: CloneSpec, *, bind_seed: object) -> None:
            assert callable(bind_seed)
            await bind_seed("pool-1a2b")  # picked, then its hand-off failed; no other member
            records.append(record())

        async def pool_status(self) -> list[PoolStatus]:
            return [PoolStatus("p1", "st-1", 1, 0, "")]

        async def clone_from_state(self, state_id: str, spec: CloneSpec) -> str:
            assert spec.seed == str(seed_path)
            records.append(record())
            return "clone"

    prov = Provisioner(Fleet(), tmp_path)  # type: ignore[arg-type]
    req = ProvisionRequest(
        "web-1", "alice", load_catalog().resolve("minimal"), source="pool", pool_key="p1"
    )
    assert await prov._make(req, seed_path, 8120) == "clone"
    assert records[0]["standby_of"] == "pool-1a2b"
    assert "standby_of" not in records[1]


async def test_an_empty_pool_leaves_the_seed_alone_and_an_unbind_that_fails_is_only_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from agentic_sandbox.fleet import CloneSpec, PoolStatus
    from agentic_sandbox.provision import Provisioner, ProvisionRequest, pipeline

    seed_path = write_seed_iso(
        tmp_path / "web-1.iso",
        SeedFiles("#cloud-config\n{}\n", "x: 1\n", front=b'{"instance_id":"web-1"}'),
    )
    before = seed_path.read_bytes()
    picks: list[str] = []
    unbinds: list[str] = []

    class Fleet:
        async def take_from_pool(self, key: str, spec: CloneSpec, *, bind_seed: object) -> None:
            assert callable(bind_seed)
            for member in picks:
                await bind_seed(member)

        async def pool_status(self) -> list[PoolStatus]:
            return [PoolStatus("p1", "st-1", 1, 0, "")]

        async def clone_from_state(self, state_id: str, spec: CloneSpec) -> str:
            return "clone"

    prov = Provisioner(Fleet(), tmp_path)  # type: ignore[arg-type]
    req = ProvisionRequest(
        "web-1", "alice", load_catalog().resolve("minimal"), source="pool", pool_key="p1"
    )
    assert await prov._make(req, seed_path, 8120) == "clone"
    assert seed_path.read_bytes() == before  # nothing bound: nothing rewritten

    real = pipeline.bind_to_member

    def bind(path: Path, member: str) -> bool:
        if not member:
            unbinds.append(str(path))
            raise OSError("I/O error")
        return real(path, member)

    monkeypatch.setattr(pipeline, "bind_to_member", bind)
    picks.append("pool-1a2b")
    with caplog.at_level(logging.WARNING):
        assert await prov._make(req, seed_path, 8120) == "clone"
    assert unbinds == [str(seed_path)]
    assert "unbinding the seed from pool-1a2b failed: I/O error" in caplog.text
