"""Importing a user's cloud image (real qemu-img on tiny files) and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentic_sandbox.images import ImageBuilder, ImageStore, InvalidImage
from agentic_sandbox.images.cli import main
from tests.support.fake_images import publish_fake

REPO = Path(__file__).parents[3]


def qcow2(path: Path, size: str = "16M", backing: Path | None = None) -> Path:
    argv = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing is not None:
        argv += ["-F", "qcow2", "-b", str(backing)]
    subprocess.run([*argv, str(path), size], check=True)
    return path


def test_import_cloud_image(tmp_path: Path) -> None:
    src = qcow2(tmp_path / "Debian-12-GenericCloud.qcow2")
    os.chmod(src, 0o640)
    builder = ImageBuilder(tmp_path / "cache")
    image = builder.import_cloud_image(src)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    assert image.name == f"cloud-debian-12-genericcloud-{digest[:12]}"
    assert image.kind == "cloud" and not image.cached
    assert image.needs_agent_runtime and not image.agent_runtime_baked
    assert not image.direct_kernel_boot and image.kernel is None and image.kernel_cmdline is None
    assert image.manifest.content_hash == digest
    assert image.manifest.disk.virtual_size == 16 << 20
    assert image.disk.read_bytes() == src.read_bytes()
    assert image.disk.stat().st_mode & 0o777 == 0o444
    assert src.stat().st_mode & 0o777 == 0o640  # a copy: the user's file is untouched
    assert ImageStore(tmp_path / "cache").get(image.name).kind == "cloud"
    again = builder.import_cloud_image(src)
    assert again.cached and again.name == image.name
    assert list(builder.store.tmp_dir.iterdir()) == []


def test_import_with_name_and_link(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    src = qcow2(cache / "upload.qcow2")
    image = ImageBuilder(cache).import_cloud_image(src, name="My Ubuntu 24.04", link=True)
    assert image.name.startswith("my-ubuntu-24.04-")
    assert image.disk.stat().st_ino == src.stat().st_ino
    assert "hard link" in (image.manifest.source or "")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.with_name("missing.qcow2"), "no such file"),
        (lambda p: (p.write_bytes(b"\0" * 65536), p)[1], "format is 'raw'"),
        (lambda p: qcow2(p, backing=qcow2(p.with_name("base.qcow2"))), "backing file"),
    ],
)
def test_import_rejects_unusable_files(tmp_path: Path, make: object, message: str) -> None:
    path = make(tmp_path / "in.qcow2")  # type: ignore[operator]
    with pytest.raises(InvalidImage, match=message):
        ImageBuilder(tmp_path / "cache").import_cloud_image(path)
    store = ImageStore(tmp_path / "cache")
    assert store.list() == []


def test_cli_recipes_name_list_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "debian-12-agent" in out and "-> debian-12-agent-" in out
    assert main(["name", "debian-12-agent"]) == 0
    name = capsys.readouterr().out.strip()
    assert name.startswith("debian-12-agent-") and len(name) == len("debian-12-agent-") + 12
    assert main(["list", "--cache-dir", str(cache)]) == 0
    assert "no images" in capsys.readouterr().out
    publish_fake(ImageStore(cache), name, "debian-12-agent")
    assert main(["list", "--cache-dir", str(cache), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["name"] == name and listed[0]["disk"].endswith("disk.qcow2")
    assert main(["show", name, "--cache-dir", str(cache)]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == name
    # a cached build through the CLI
    assert main(["build", "debian-12-agent", "--cache-dir", str(cache), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cached"] is True
    assert main(["delete", name, "--cache-dir", str(cache)]) == 0
    assert main(["show", name, "--cache-dir", str(cache)]) == 1
    assert "no image" in capsys.readouterr().err


def test_cli_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", str(tmp_path / "nope.yaml"), "--cache-dir", str(tmp_path)]) == 1
    assert "recipe file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsuite: bookworm\n")
    assert main(["build", str(bad), "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "mirror: Field required" in err and "packages: Field required" in err
    assert main(["import", str(tmp_path / "missing.qcow2"), "--cache-dir", str(tmp_path)]) == 1
    assert "no such file" in capsys.readouterr().err


def test_python_dash_m_images(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentic_sandbox.images", "list", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0 and "no images" in proc.stdout
