"""The agent's path checks and tar member checks: what a string check refuses, what only the
component-by-component resolution (O_NOFOLLOW) can see, and what a tar stream may not carry."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from agentic_sandbox.agent import tarstream
from agentic_sandbox.agent.paths import FileRefused, locate, split


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("relative/x", "absolute"),
        ("/a/../etc/passwd", "'..'"),
        ("/a/./b", "'.'"),
        ("/a//b", "empty"),
        ("/a\x00b", "NUL"),
        ("/" + "x" * 256, "255"),
        ("/" + "a/" * 2100, "4096"),
    ],
)
def test_bad_paths_are_refused_by_name(path: str, why: str) -> None:
    with pytest.raises(FileRefused) as info:
        split(path)
    assert info.value.code == "bad-path" and info.value.field == "path"
    assert why in info.value.message


def test_good_paths_split_into_components() -> None:
    assert split("/") == []
    assert split("/etc/hosts") == ["etc", "hosts"]
    assert split("/srv/dir/") == ["srv", "dir"]


def test_a_symlink_on_the_way_is_refused_unless_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "link").symlink_to(outside)
    with pytest.raises(FileRefused) as info:
        locate(str(tree / "link" / "secret"))
    assert info.value.code == "symlink" and str(tree / "link") in info.value.message
    with locate(str(tree / "link" / "secret"), follow=True) as loc:
        assert loc.name == "secret"
        assert os.stat(loc.name, dir_fd=loc.dir_fd).st_size == 1


def test_missing_and_not_a_directory_are_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileRefused) as info:
        locate(str(tmp_path / "nope" / "x"))
    assert info.value.code == "not-found" and str(tmp_path / "nope") in info.value.message
    with pytest.raises(FileRefused) as info:
        locate(str(tmp_path / "file" / "x"))
    assert info.value.code == "not-a-directory"
    with locate(str(tmp_path / "new" / "deeper" / "x"), parents=True) as loc:
        assert loc.name == "x"
    assert (tmp_path / "new" / "deeper").is_dir()


def _tar(*members: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(data) if m.isreg() else None)
    return buf.getvalue()


def _member(
    name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 0
) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = kind
    m.linkname = link
    m.size = size
    return m


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_member("/etc/passwd"), "absolute"),
        (_member("../escape"), "'..'"),
        (_member("a/../../escape"), "'..'"),
        (_member("hard", tarfile.LNKTYPE, "a"), "hard links"),
        (_member("dev", tarfile.CHRTYPE), "only files"),
        (_member("fifo", tarfile.FIFOTYPE), "only files"),
        (_member("abs", tarfile.SYMTYPE, "/etc"), "absolute"),
        (_member("a/out", tarfile.SYMTYPE, "../../etc"), "out of the tree"),
    ],
)
def test_tar_members_that_could_escape_are_refused(member: tarfile.TarInfo, why: str) -> None:
    with pytest.raises(FileRefused) as info:
        tarstream.member_parts(member)
    assert info.value.code == "bad-tar" and why in info.value.message


def test_tar_members_inside_the_tree_are_accepted() -> None:
    assert tarstream.member_parts(_member("./a/b.txt")) == ["a", "b.txt"]
    assert tarstream.member_parts(_member("a/up", tarfile.SYMTYPE, "../b")) == ["a", "up"]
    assert tarstream.member_parts(_member(".", tarfile.DIRTYPE)) == []


def _extract(raw: bytes, root: Path) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tarstream.extract(
            io.BytesIO(raw), fd, chown=lambda m: None, canceled=lambda: False, where=str(root)
        )
    finally:
        os.close(fd)


def test_a_symlink_member_is_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    # "link" -> "." is inside the tree, but a later "link/x" must not be written through it
    raw = _tar(_member("link", tarfile.SYMTYPE, "."), _member("link/x", size=1), data=b"x")
    with pytest.raises(FileRefused) as info:
        _extract(raw, root)
    assert info.value.code == "symlink"
    assert not (root / "x").exists() and list(outside.iterdir()) == []


def test_a_repeated_name_is_refused_and_a_good_tree_unpacks(tmp_path: Path) -> None:
    raw = _tar(_member("a", size=1), _member("a", size=1), data=b"1")
    root = tmp_path / "dup"
    root.mkdir()
    with pytest.raises(FileRefused) as info:
        _extract(raw, root)
    assert "repeats" in info.value.message
    d = _member("sub", tarfile.DIRTYPE)
    d.mode = 0o750
    f = _member("sub/f.txt", size=5)
    f.mode = 0o600
    good = tmp_path / "good"
    good.mkdir()
    assert _extract(_tar(d, f, data=b"hello"), good) == 2
    assert (good / "sub" / "f.txt").read_bytes() == b"hello"
    assert (good / "sub" / "f.txt").stat().st_mode & 0o777 == 0o600
    assert (good / "sub").stat().st_mode & 0o777 == 0o750
