"""Manifest shape, rootfs customization on a fake tree, geometry, progress."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import yaml

from agentic_sandbox.images import ImageBuilder, InvalidImage, Progress, load_recipe
from agentic_sandbox.images.builder import _Build
from agentic_sandbox.images.disk import filesystem_geometry
from agentic_sandbox.images.manifest import BuiltImage, read_manifest
from agentic_sandbox.images.process import CommandRunner
from agentic_sandbox.images.progress import DebootstrapProgress, ProgressTracker
from agentic_sandbox.images.rootfs import (
    CLOUD_CFG_NAME,
    customize_tree,
    guest,
    kernel_files,
    read_accounts,
    seal_tree,
    tree_usage,
)
from tests.support.fake_images import fake_manifest


def test_builder_writes_the_documented_manifest(tmp_path: Path) -> None:
    recipe = load_recipe("debian-12-agent")
    with open(tmp_path / "build.log", "w") as log:
        b = _Build(
            recipe,
            recipe.image_name(),
            tmp_path,
            CommandRunner(log),
            ProgressTracker(None),
            threading.Event(),
        )
        b.timings.update(debootstrap=60.0, total=75.0)
        b.sizes.update(qcow2_bytes=123, rootfs_bytes=456)
        b.facts.update(
            packages={"cloud-init": "22.4.2-1", "systemd": "252.39-1"},
            python_version="3.11.2",
            kernel_version="6.1.0-50-cloud-amd64",
            users=["root:0"],
            groups=["root:0", "sudo:27"],
            agent_packages={"grpcio": "1.85.3"},
            disk_sha256="ab" * 32,
            virtual_size=1 << 30,
        )
        ImageBuilder(tmp_path / "cache")._stage_finalize(b)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert set(data) == {
        "manifest_version",
        "name",
        "kind",
        "recipe_name",
        "recipe",
        "content_hash",
        "builder_version",
        "created_at",
        "disk",
        "boot",
        "guest",
        "agent_runtime_baked",
        "sizes",
        "timings",
        "source",
    }
    assert data["kind"] == "built" and data["manifest_version"] == 1
    assert data["name"] == recipe.image_name()
    assert data["content_hash"] == recipe.content_hash()
    assert data["recipe"]["suite"] == "bookworm"
    assert data["disk"] == {
        "file": "disk.qcow2",
        "format": "qcow2",
        "virtual_size": 1 << 30,
        "actual_size": 123,
        "compression": "zstd",
        "sha256": "ab" * 32,
    }
    assert data["boot"] == {
        "direct_kernel": True,
        "kernel": "vmlinuz",
        "initrd": "initrd.img",
        "kernel_version": "6.1.0-50-cloud-amd64",
        "root_label": "agentic-root",
        "cmdline": "root=LABEL=agentic-root ro console=ttyS0,115200n8 net.ifnames=0",
    }
    g = data["guest"]
    assert g["agent_venv"] == "/opt/agentic-sandbox/venv"
    assert g["agent_python"] == "/opt/agentic-sandbox/venv/bin/python"
    assert g["python"] == "/usr/bin/python3" and g["nocloud_label"] == "cidata"
    assert g["cloud_init_version"] == "22.4.2-1" and g["package_count"] == 2
    assert data["agent_runtime_baked"] is True
    assert data["timings"]["total"] == 75.0


def test_manifest_roundtrip_and_builtimage(tmp_path: Path) -> None:
    m = fake_manifest("fake-0123456789ab", b"x")
    (tmp_path / "manifest.json").write_text(m.to_json())
    back = read_manifest(tmp_path)
    assert back == m
    image = BuiltImage(path=tmp_path, manifest=back)
    assert image.disk == tmp_path / "disk.qcow2" and image.initrd == tmp_path / "initrd.img"
    assert image.direct_kernel_boot and not image.needs_agent_runtime
    assert image.agent_python == "/opt/agentic-sandbox/venv/bin/python"
    # unknown keys from a newer builder do not make an image unreadable
    data = json.loads(m.to_json())
    data["future_field"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path).name == m.name
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(InvalidImage, match="unreadable manifest"):
        read_manifest(tmp_path)
    del data["disk"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(InvalidImage, match="invalid manifest: disk"):
        read_manifest(tmp_path)


def _fake_rootfs(root: Path) -> None:
    for d in (
        "etc/ssh",
        "etc/systemd/system/timers.target.wants",
        "var/lib/dbus",
        "var/lib/cloud/instances",
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "boot",
        "usr/share/zoneinfo/Etc",
        "var/log",
    ):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/machine-id").write_text("72618276a1f041149c6d0995ababeac7\n")
    (root / "var/lib/dbus/machine-id").write_text("72618276a1f041149c6d0995ababeac7\n")
    for k in ("rsa", "ed25519"):
        (root / f"etc/ssh/ssh_host_{k}_key").write_text("secret")
        (root / f"etc/ssh/ssh_host_{k}_key.pub").write_text("pub")
    (root / "etc/resolv.conf").write_text("nameserver 192.0.2.53\n")
    (root / "etc/systemd/system/timers.target.wants/apt-daily.timer").symlink_to(
        "/lib/systemd/system/apt-daily.timer"
    )
    (root / "var/cache/apt/archives/x.deb").write_bytes(b"deb")
    (root / "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease").write_text("x")
    (root / "var/log/dpkg.log").write_text("lots\n")
    for v in ("6.1.0-9-cloud-amd64", "6.1.0-50-cloud-amd64"):
        (root / f"boot/vmlinuz-{v}").write_bytes(b"k")
        (root / f"boot/initrd.img-{v}").write_bytes(b"i")
    (root / "boot/vmlinuz-6.1.0-99-cloud-amd64").write_bytes(b"no initrd")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\nsshd:x:101:65534::/:\n")
    (root / "etc/group").write_text("root:x:0:\nsudo:x:27:\n")


def test_customize_and_seal_a_tree(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    _fake_rootfs(root)
    recipe = load_recipe("debian-12-agent")
    customize_tree(root, recipe)
    seal_tree(root)

    assert (root / "etc/machine-id").read_text() == ""
    assert os.readlink(root / "var/lib/dbus/machine-id") == "/etc/machine-id"
    assert list((root / "etc/ssh").glob("ssh_host_*")) == []
    assert (root / "etc/resolv.conf").read_text() == ""
    assert not (root / "etc/resolv.conf").is_symlink()
    assert "LABEL=agentic-root\t/\text4" in (root / "etc/fstab").read_text()
    assert (root / "etc/hostname").read_text() == "agentic-sandbox\n"
    assert (root / "etc/default/locale").read_text() == "LANG=C.UTF-8\n"
    assert os.readlink(root / "etc/localtime") == "/usr/share/zoneinfo/Etc/UTC"
    cfg = yaml.safe_load((root / "etc/cloud/cloud.cfg.d" / CLOUD_CFG_NAME).read_text())
    assert cfg["datasource_list"] == ["NoCloud", "None"]
    assert cfg["locale"] == "C.UTF-8" and cfg["manage_etc_hosts"] is True
    assert cfg["system_info"]["network"]["renderers"] == ["networkd"]
    # timers masked and their enablement links gone
    for unit in ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "man-db.timer"):
        assert os.readlink(root / "etc/systemd/system" / unit) == "/dev/null"
    assert not (root / "etc/systemd/system/timers.target.wants/apt-daily.timer").is_symlink()
    assert (
        'APT::Periodic::Enable "0"'
        in (root / "etc/apt/apt.conf.d/10agentic-no-periodic").read_text()
    )
    assert (
        "ssh-keygen"
        in (root / "etc/systemd/system/ssh.service.d/10-agentic-host-keys.conf").read_text()
    )
    # no IPv6 router advertisements on the network file cloud-init will write (no ~12 s wait)
    no_ra = root / "etc/systemd/network/10-cloud-init-eth0.network.d/90-agentic-no-ra.conf"
    assert "\nIPv6AcceptRA=no\n" in no_ra.read_text()
    assert "net.ifnames=0" in recipe.disk.kernel_args  # so that the network file is eth0's
    sshd = (root / "etc/ssh/sshd_config.d/10-agentic-keys-only.conf").read_text()
    assert "PasswordAuthentication no" in sshd
    assert cfg["grub_dpkg"] == {"enabled": False}
    # caches and state out
    assert not (root / "var/lib/cloud").exists()
    assert list((root / "var/cache/apt/archives").iterdir()) == []
    assert list((root / "var/lib/apt/lists").iterdir()) == []
    assert (root / "var/log/dpkg.log").read_text() == ""
    assert (root / "tmp").stat().st_mode & 0o7777 == 0o1777
    # idempotent
    customize_tree(root, recipe)
    seal_tree(root)


def test_recipe_files_are_written_with_mode(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    _fake_rootfs(root)
    data = yaml.safe_load(
        (
            Path(__file__).parents[3] / "agentic_sandbox/images/recipes/debian-12-agent.yaml"
        ).read_text()
    )
    data["customize"]["files"] = [{"path": "/etc/motd.d/x", "content": "hi\n", "mode": "0600"}]
    from agentic_sandbox.images import parse_recipe

    customize_tree(root, parse_recipe(data))
    assert (root / "etc/motd.d/x").read_text() == "hi\n"
    assert (root / "etc/motd.d/x").stat().st_mode & 0o777 == 0o600


def test_guest_paths_cannot_escape(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "evil").symlink_to("/tmp")
    assert guest(root, "/etc/hostname") == root / "etc/hostname"
    with pytest.raises(ValueError, match="escapes"):
        guest(root, "/../../etc/passwd")
    with pytest.raises(ValueError, match="symlink"):
        guest(root, "/evil/file")


def test_kernel_accounts_and_usage(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    _fake_rootfs(root)
    vmlinuz, initrd, version = kernel_files(root)
    assert version == "6.1.0-50-cloud-amd64"  # newest with an initrd, numeric ordering
    assert vmlinuz.name == "vmlinuz-6.1.0-50-cloud-amd64" and initrd.is_file()
    users, groups = read_accounts(root)
    assert users == ["root:0", "sshd:101"] and "sudo:27" in groups
    content, inodes = tree_usage(root)
    assert content > 0 and inodes > 20
    with pytest.raises(FileNotFoundError):
        kernel_files(tmp_path)


def test_filesystem_geometry() -> None:
    mib = 1 << 20
    size, inodes = filesystem_geometry(480 * mib, 18000, 256)
    assert size % (64 * mib) == 0
    assert size >= 480 * mib + 256 * mib
    assert inodes > 18000
    bigger, _ = filesystem_geometry(480 * mib, 18000, 1024)
    assert bigger > size


def test_progress_is_monotonic_and_weighted() -> None:
    seen: list[Progress] = []
    t = ProgressTracker(seen.append)
    t.report("prepare", 0.0, "a")
    t.report("debootstrap", 0.5, "b")
    t.report("debootstrap", 0.2, "regress")  # overall never goes back
    t.report("convert", 1.0, "c")
    t.report("done", 1.0, "d")
    fractions = [p.fraction for p in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert seen[1].stage_fraction == 0.5 and 0.2 < seen[1].fraction < 0.5

    def boom(p: Progress) -> None:
        raise RuntimeError("callback bug")

    ProgressTracker(boom).report("prepare", 0.0, "a callback error never breaks a build")


def test_debootstrap_progress_parses_lines() -> None:
    reports: list[tuple[float, str]] = []
    dp = DebootstrapProgress(lambda f, m: reports.append((f, m)), expected_packages=4)
    for line in [
        "I: Retrieving InRelease",
        "I: Resolving dependencies of required packages...",
        "I: Retrieving adduser 3.134",
        "I: Retrieving bash 5.2",
        "I: Validating adduser 3.134",
        "I: Extracting bash...",
        "I: Unpacking bash...",
        "I: Configuring bash...",
        "W: something",
        "random noise",
    ]:
        dp.feed(line)
    fractions = [f for f, _ in reports]
    assert fractions[-1] > 0.6 and all(0 <= f <= 1 for f in fractions)
    assert reports[-1][1] == "Configuring bash..."
