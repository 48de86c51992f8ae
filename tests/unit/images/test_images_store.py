"""The cache: atomic publish, cache hits, half-built leftovers, deletion, safe removal."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentic_sandbox.images import (
    BuildCancelled,
    ImageBuilder,
    ImageError,
    ImageNotFound,
    ImageStore,
    Tools,
)
from agentic_sandbox.images.mounts import mounts_under, remove_tree
from tests.support.fake_images import publish_fake, write_image_files

NAME = "fake-0123456789ab"


def test_empty_store(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    assert store.list() == []
    assert store.find(NAME) is None
    with pytest.raises(ImageNotFound, match=NAME):
        store.get(NAME)
    with pytest.raises(ImageNotFound, match="invalid image name"):
        store.get("../../etc")


def test_publish_makes_a_readonly_complete_image(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    publish_fake(store, NAME)
    image = store.get(NAME)
    assert image.path == store.images_dir / NAME
    assert image.disk.read_bytes().startswith(b"QFI")
    assert image.kernel == image.path / "vmlinuz"
    assert image.kernel_cmdline == "root=LABEL=agentic-root ro console=ttyS0"
    for f in image.path.iterdir():
        assert f.stat().st_mode & 0o777 == 0o444, f
    for d in (store.root, store.images_dir, image.path):
        assert d.stat().st_mode & 0o777 == 0o755, d
    assert [i.name for i in store.list()] == [NAME]
    assert store.latest("fake") is not None and store.latest("other") is None
    assert store.verify(NAME)
    assert list(store.tmp_dir.iterdir()) == []  # staging left nothing


def test_publish_never_replaces_a_complete_image(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    publish_fake(store, NAME)
    with pytest.raises(ImageError, match="already exists"):
        publish_fake(store, NAME)
    assert store.get(NAME).disk.is_file()


def test_staging_is_removed_on_failure(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    with pytest.raises(RuntimeError), store.staging(NAME) as tmp:
        (tmp / "rootfs").mkdir()
        (tmp / "rootfs" / "file").write_text("x")
        raise RuntimeError("boom")
    assert list(store.tmp_dir.iterdir()) == []
    assert store.find(NAME) is None


def test_half_built_leftovers_are_never_used_and_are_cleaned(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    store.ensure_layout()
    # 1. a crashed build's temp dir (nobody holds its lock)
    crashed = store.tmp_dir / f"{NAME}.deadbeef"
    write_image_files(crashed, NAME)
    (store.tmp_dir / f"{NAME}.deadbeef.lock").write_text("")
    # 2. an image dir without a manifest (e.g. copied in by hand, interrupted)
    partial = store.images_dir / "fake-bbbbbbbbbbbb"
    partial.mkdir()
    (partial / "disk.qcow2").write_bytes(b"half")
    # 3. an image whose disk is missing: not usable, but kept for an operator to look at
    broken = store.images_dir / "fake-cccccccccccc"
    write_image_files(broken, "fake-cccccccccccc")
    (broken / "disk.qcow2").unlink()

    assert store.list() == []
    assert store.find("fake-bbbbbbbbbbbb") is None
    with pytest.raises(ImageNotFound, match=r"incomplete: disk\.qcow2 is missing"):
        store.get("fake-cccccccccccc")

    removed = store.clean_stale(grace_s=0)
    assert crashed in removed and partial in removed
    assert not crashed.exists() and not partial.exists()
    assert broken.exists()
    assert not (store.tmp_dir / f"{NAME}.deadbeef.lock").exists()


def test_a_live_build_dir_is_not_cleaned(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    with store.staging(NAME) as tmp:
        (tmp / "rootfs").mkdir()
        assert store.clean_stale(grace_s=0) == []
        assert tmp.exists()
    # A dir that just appeared without a lock file yet is also left alone within the grace time.
    young = store.tmp_dir / f"{NAME}.young"
    young.mkdir()
    assert store.clean_stale(grace_s=60) == []
    assert young.exists()


def test_delete(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    publish_fake(store, NAME)
    store.delete(NAME)
    assert store.find(NAME) is None
    assert not (store.images_dir / NAME).exists()
    assert list(store.tmp_dir.iterdir()) == []
    with pytest.raises(ImageNotFound):
        store.delete(NAME)


def test_lock_wait_honours_cancel(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "cache")
    cancel = threading.Event()
    with store.lock(NAME):
        timer = threading.Timer(0.3, cancel.set)
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(BuildCancelled), store.lock(NAME, cancel):
            pass
        assert time.monotonic() - t0 < 3
    with store.lock(NAME):  # free again
        pass


def test_cache_hit_runs_no_tool(tmp_path: Path) -> None:
    """(How fast a hit is lives in tests/bench/bench_images.py, not here.)"""
    builder = ImageBuilder(
        tmp_path / "cache",
        tools=Tools(
            debootstrap="/nonexistent/debootstrap",
            mkfs="/nonexistent/mkfs",
            qemu_img="/nonexistent/qemu-img",
            chroot="/nonexistent/chroot",
            pip=("/nonexistent/pip",),
        ),
    )
    name = builder.image_name("debian-12-agent")
    publish_fake(builder.store, name, "debian-12-agent")
    seen = []
    image = builder.build("debian-12-agent", progress=seen.append)
    assert image.cached and image.name == name
    assert [p.stage for p in seen] == ["cached"] and seen[0].fraction == 1.0
    assert builder.cached("debian-12-agent") is not None


def test_unusable_image_of_the_same_name_is_reported_not_rebuilt(tmp_path: Path) -> None:
    builder = ImageBuilder(tmp_path / "cache", require_root=False)
    name = builder.image_name("debian-12-agent")
    broken = builder.store.images_dir / name
    write_image_files(broken, name, "debian-12-agent")
    (broken / "vmlinuz").unlink()
    with pytest.raises(ImageError, match="vmlinuz is missing; delete it"):
        builder.build("debian-12-agent")


def test_mounts_under_parses_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /proc rw - proc proc rw\n"
        "30 22 0:5 / /work/tmp/x/rootfs/proc rw - proc proc rw\n"
        "31 22 0:5 / /work/tmp/x/rootfs/dev\\040pts rw - devpts devpts rw\n"
        "32 22 0:5 / /work/tmp/xy rw - tmpfs tmpfs rw\n"
        "33 22 0:5 / /work/tmp/x rw - tmpfs tmpfs rw\n"
    )
    found = mounts_under(Path("/work/tmp/x"), info)
    assert found == [
        Path("/work/tmp/x/rootfs/proc"),
        Path("/work/tmp/x/rootfs/dev pts"),
        Path("/work/tmp/x"),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_remove_tree_unmounts_instead_of_descending(tmp_path: Path) -> None:
    tree = tmp_path / "build" / "rootfs"
    inner = tree / "proc"
    inner.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(inner)], check=True)
    (inner / "must-survive-elsewhere").write_text("x")
    (tree / "etc").mkdir()
    (tree / "etc" / "ro").write_text("x")
    os.chmod(tree / "etc" / "ro", 0o444)
    os.chmod(tree / "etc", 0o555)
    assert mounts_under(tree) == [inner]
    remove_tree(tmp_path / "build")
    assert not (tmp_path / "build").exists()
    assert mounts_under(tmp_path) == []
