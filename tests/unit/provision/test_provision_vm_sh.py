"""provision-vm.sh: argument errors, --dry-run (touches nothing), --json."""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[3] / "provision" / "provision-vm.sh"


def run(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args, "--data-dir", str(tmp), "--no-server"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_usage_errors_exit_2_with_a_message(tmp_path: Path) -> None:
    for args, fragment in (
        (["Bad_Name"], "NAME"),
        (["vm-1", "--cpus", "0"], "--cpus"),
        (["vm-1", "--memory", "1"], "--memory"),
        (["vm-1", "--ssh-key", "/nope"], "--ssh-key /nope"),
        (["vm-1", "--loadout", "nope"], "--loadout 'nope'"),
        (["vm-1", "--from-snapshot", "x"], "INSTANCE/SNAPSHOT"),
        (["vm-1", "--network", "open"], "invalid choice"),
        (
            ["vm-1", "--network", "allowlist", "--allow", "x"],
            "--allow 'x': 'x': expected HOST:PORT",
        ),
        (["vm-1", "--network", "allowlist", "--allow", "*x.org:443"], "wildcard"),
        (["vm-1", "--network", "nat", "--allow", "a.example:443"], "needs --network allowlist"),
        (["vm-1", "--network", "allowlist", "--allow", "a.example:443"], "needs the server"),
    ):
        res = run(*args, tmp=tmp_path)
        assert res.returncode == 2, (args, res.stderr)
        assert fragment in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr


def test_dry_run_prints_xml_and_user_data_and_touches_nothing(tmp_path: Path) -> None:
    key = tmp_path / "id.pub"
    key.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHx0 me@host\n")
    res = run(
        "vm-7", "--dry-run", "--cpus", "2", "--memory", "768", "--ssh-key", str(key), tmp=tmp_path
    )
    assert res.returncode == 0, res.stderr
    xml_text, user_data = res.stdout.split("# user-data\n", 1)
    root = ET.fromstring(xml_text.removeprefix("# domain XML\n").strip())
    assert root.findtext("name") == "sbx-vm-7"
    assert root.findtext("vcpu") == "2" and root.findtext("memory") == "768"
    doc = yaml.safe_load(user_data)
    assert doc["users"][0]["ssh_authorized_keys"] == [key.read_text().strip()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id.pub"]  # nothing created


def test_dry_run_json(tmp_path: Path) -> None:
    res = run("vm-8", "--dry-run", "--json", "--network", "nat", tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["dry_run"] is True and "restrict=on" not in out["domain_xml"]
    assert "network_config" in out and "dhcp4: true" in out["network_config"]
