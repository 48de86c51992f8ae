"""Subprocess handling, cancellation and failure cleanup, with fake long-running build tools."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from agentic_sandbox.images import BuildCancelled, BuildError, ImageBuilder, Progress, Tools
from agentic_sandbox.images.mounts import mounts_under
from agentic_sandbox.images.process import CommandRunner
from tests.support.fake_images import write_script


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# ---- CommandRunner --------------------------------------------------------------------------


def test_runner_logs_and_captures(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with open(log, "w") as f:
        runner = CommandRunner(f)
        out = runner.run(["sh", "-c", "echo out; echo err >&2"], stage="t", capture=True)
        lines: list[str] = []
        runner.run(["printf", "a\\nb\\n"], stage="t", on_line=lines.append)
    assert out == "out\n"
    assert lines == ["a", "b"]
    text = log.read_text()
    assert "$ sh -c echo out; echo err >&2" in text and "err" in text and "# exit 0" in text


def test_runner_failure_names_stage_and_log(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as f:
        runner = CommandRunner(f)
        with pytest.raises(BuildError) as exc:
            runner.run(["sh", "-c", "exit 3"], stage="mkfs")
        assert exc.value.stage == "mkfs"
        assert "exited with status 3" in str(exc.value)
        assert str(tmp_path / "log") in str(exc.value)
        with pytest.raises(BuildError, match="cannot run /nonexistent"):
            runner.run(["/nonexistent"], stage="x")


def test_runner_timeout_kills_the_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    with open(tmp_path / "log", "w") as f:
        runner = CommandRunner(f)
        t0 = time.monotonic()
        with pytest.raises(BuildError, match="timed out"):
            runner.run(
                ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], stage="t", timeout=0.5
            )
        assert time.monotonic() - t0 < 8
    child = int(pidfile.read_text())
    assert not _alive(child)


def test_cancel_kills_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    cancel = threading.Event()
    with open(tmp_path / "log", "w") as f:
        runner = CommandRunner(f, cancel)
        threading.Timer(0.5, cancel.set).start()
        t0 = time.monotonic()
        with pytest.raises(BuildCancelled):
            # the child ignores SIGTERM: it must still die (SIGKILL after the grace time)
            runner.run(
                ["sh", "-c", f"sh -c 'trap \"\" TERM; sleep 60' & echo $! > {pidfile}; wait"],
                stage="t",
            )
        assert time.monotonic() - t0 < 10
    assert not _alive(int(pidfile.read_text()))
    with open(tmp_path / "log2", "w") as f, pytest.raises(BuildCancelled):
        CommandRunner(f, cancel).run(["true"], stage="t")  # already cancelled: never starts


# ---- the builder with fake tools -----------------------------------------------------------


def _fake_tools(tmp_path: Path, debootstrap_body: str) -> Tools:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pip = write_script(bin_dir / "pip", "exit 0\n")
    debootstrap = write_script(bin_dir / "debootstrap", debootstrap_body)
    return Tools(debootstrap=str(debootstrap), pip=(str(pip),))


# debootstrap's positional arguments end with: SUITE TARGET MIRROR
_TARGET = 'for a in "$@"; do prev2="$prev1"; prev1="$a"; done; target="$prev2"\n'


def _leftovers(builder: ImageBuilder) -> list[Path]:
    return [p for p in builder.store.tmp_dir.iterdir()] if builder.store.tmp_dir.exists() else []


def test_failed_step_leaves_nothing_but_a_log(tmp_path: Path) -> None:
    tools = _fake_tools(
        tmp_path,
        _TARGET + 'mkdir -p "$target/etc"; echo "E: Couldn\'t download packages"; exit 1\n',
    )
    builder = ImageBuilder(tmp_path / "cache", tools=tools, require_root=False)
    with pytest.raises(BuildError) as exc:
        builder.build("debian-12-agent")
    err = exc.value
    assert err.stage == "debootstrap" and "exited with status 1" in str(err)
    assert err.log_path and Path(err.log_path).is_file()
    assert "Couldn't download packages" in Path(err.log_path).read_text()
    assert Path(err.log_path).parent == builder.store.logs_dir
    assert builder.store.list() == []
    assert _leftovers(builder) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the fake debootstrap mounts a tmpfs (root)")
def test_cancel_mid_build_kills_and_cleans_up(tmp_path: Path) -> None:
    pidfile = tmp_path / "debootstrap.pid"
    # Like a real debootstrap: makes the tree, mounts /proc-like fs inside it, then works.
    tools = _fake_tools(
        tmp_path,
        _TARGET
        + 'mkdir -p "$target/proc" "$target/usr"; mount -t tmpfs tmpfs "$target/proc"\n'
        + 'echo "I: Retrieving libc6 2.36"\n'
        + f"echo $$ > {pidfile}; sleep 60; echo never\n",
    )
    builder = ImageBuilder(tmp_path / "cache", tools=tools)
    cancel = threading.Event()
    seen: list[Progress] = []
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            builder.build("debian-12-agent", progress=seen.append, cancel=cancel)
        except BaseException as err:
            result["err"] = err

    t = threading.Thread(target=run)
    t.start()
    _wait_for(pidfile)
    pid = int(pidfile.read_text())
    cancel.set()
    t0 = time.monotonic()
    t.join(timeout=20)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 10
    assert isinstance(result.get("err"), BuildCancelled), result
    assert "debootstrap" in str(result["err"])
    assert not _alive(pid)
    assert _leftovers(builder) == []
    assert mounts_under(builder.store.root) == []
    assert builder.store.list() == []
    assert any(p.stage == "debootstrap" for p in seen)
    cancelled_logs = list(builder.store.logs_dir.glob("*.cancelled.log"))
    assert len(cancelled_logs) == 1


def test_build_async_cancel(tmp_path: Path) -> None:
    pidfile = tmp_path / "debootstrap.pid"
    tools = _fake_tools(tmp_path, _TARGET + f'mkdir -p "$target"; echo $$ > {pidfile}; sleep 60\n')
    builder = ImageBuilder(tmp_path / "cache", tools=tools, require_root=False)

    async def scenario() -> None:
        seen: list[Progress] = []
        task = asyncio.create_task(builder.build_async("debian-12-agent", progress=seen.append))
        while not pidfile.exists():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # cleanup has finished by the time the cancelled task returns
        assert _leftovers(builder) == []
        assert not _alive(int(pidfile.read_text()))
        assert seen and seen[0].stage == "prepare"

    asyncio.run(scenario())


def test_manifestless_leftover_of_the_same_name_does_not_block_a_build(tmp_path: Path) -> None:
    tools = _fake_tools(tmp_path, _TARGET + 'mkdir -p "$target"; exit 7\n')
    builder = ImageBuilder(tmp_path / "cache", tools=tools, require_root=False)
    leftover = builder.store.images_dir / builder.image_name("debian-12-agent")
    leftover.mkdir(parents=True)
    (leftover / "disk.qcow2").write_bytes(b"partial")
    t0 = time.monotonic()
    with pytest.raises(BuildError, match="status 7"):
        builder.build("debian-12-agent")  # holds the name's lock while cleaning: no self-wait
    assert time.monotonic() - t0 < 10
    assert builder.store.find(leftover.name) is None
