"""A PTY session's process, started without Python in the child (`Popen` through `setsid
--ctty`): it leads a session of its own whose controlling terminal is the PTY, at the PTY's
size, with Ctrl-C reaching its foreground group; a signal to a session that has just been
opened never reaches the agent's own group; what `execve` would refuse is refused before the
spawn, naming the program; as root, a session runs as the asked user."""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
from pathlib import Path

import pytest

from agentic_sandbox.agent import cgroups
from agentic_sandbox.agent.session import PtySession, SpawnError
from agentic_sandbox.proto import agent_pb2 as pb


def spawn(command: list[str], **kw: object) -> PtySession:
    args: dict[str, object] = {
        "cols": 100,
        "rows": 30,
        "env": {},
        "cwd": "/tmp",
        "user": "",
        "ring_bytes": 1 << 16,
        "task_id": "",
        "on_output": lambda: None,
        "on_finish": lambda: None,
    }
    args.update(kw)
    return PtySession.spawn("s-spawn", command=command, **args)  # type: ignore[arg-type]


async def finished(sess: PtySession, timeout: float = 20) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not sess.finished:
        assert loop.time() < deadline, "the session did not finish"
        await asyncio.sleep(0.02)
    return sess.ring.read(sess.ring.start, 1 << 16).decode(errors="replace")


async def test_the_process_leads_its_session_on_the_pty() -> None:
    script = "tty; stty size; ps -o sid=,pgid=,tpgid= -p $$; trap 'echo got-int' INT; " + (
        "echo ready; sleep 10; echo after"
    )
    sess = spawn(["bash", "-c", script])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while b"ready" not in sess.ring.read(sess.ring.start, 1 << 16):
        assert loop.time() < deadline
        await asyncio.sleep(0.02)
    assert os.getsid(sess.pid) == sess.pid and os.tcgetpgrp(sess.fd) == sess.pid
    sess.send_signal("INT")
    out = await finished(sess)
    lines = out.split()
    assert lines[0].startswith("/dev/pts/") and lines[1:3] == ["30", "100"], out
    assert lines[3:6] == [str(sess.pid)] * 3, out  # session, group, the terminal's foreground
    assert "got-int" in out and "after" in out  # Ctrl-C reached it, and only interrupted sleep
    assert sess.exit is not None and sess.exit.code == 0


@pytest.mark.parametrize("name", ["HUP", "INT"])
async def test_a_signal_right_after_the_open_ends_it_and_never_reaches_the_agent(name: str) -> None:
    """Before `setsid --ctty` has run in the child there is no group and no foreground group
    yet: the signal goes to the process itself through its pidfd (it ends; INT is not dropped
    for want of a foreground group), never to group 0 (the agent's)."""
    got: list[int] = []
    sig = getattr(signal, f"SIG{name}")
    old = signal.signal(sig, lambda *_: got.append(1))
    try:
        for _ in range(10):
            sess = spawn(["sleep", "30"])
            sess.send_signal(name)
            await finished(sess, timeout=10)
            assert sess.exit is not None and sess.exit.signal == name, sess.exit
            sess.shutdown()
    finally:
        signal.signal(sig, old)
    assert got == []


def test_what_execve_would_refuse_is_refused_before_the_spawn(tmp_path: Path) -> None:
    script = tmp_path / "not-a-program"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    cases = {
        "no-such-program-here": "No such file or directory",
        str(script): "Exec format error",
        str(tmp_path): "No such file or directory",  # a directory is not a program
    }
    for program, why in cases.items():
        with pytest.raises(SpawnError, match=why) as info:
            spawn([program])
        assert repr(program) in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
async def test_as_root_the_session_runs_as_the_asked_user() -> None:
    nobody = pwd.getpwnam("nobody")
    sess = spawn(["sh", "-c", "id -u; id -g; tty"], user="nobody")
    out = (await finished(sess)).split()
    assert out[:2] == [str(nobody.pw_uid), str(nobody.pw_gid)], out
    assert out[2].startswith("/dev/pts/"), out


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and switching users need root")
async def test_a_budgeted_session_runs_in_its_cgroup_as_the_asked_user() -> None:
    """The held start: the process is in the session's cgroup before the command runs, also
    when the agent holds many descriptors (the hold is its stdin, not a high descriptor a
    POSIX shell cannot name), and the command then has the PTY as its terminal."""
    found = cgroups.detect()
    assert found.enforcement != "none", found.problem  # CI and dev hosts run as root
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(20)]  # push new fds past 9
    try:
        sess = spawn(
            ["sh", "-c", "id -u; tty; cat /proc/self/cgroup"],
            user="nobody",
            budget=pb.Budget(pids=64),
            cgroups=found,
        )
        out = await finished(sess)
    finally:
        for fd in held:
            os.close(fd)
        found.release()
    lines = out.split()
    assert lines[0] == str(pwd.getpwnam("nobody").pw_uid), out
    assert lines[1].startswith("/dev/pts/"), out
    assert "-session-s-spawn" in out, out
    assert sess.exit is not None and sess.exit.code == 0, (sess.exit, out)


async def test_the_terminals_signals_start_at_their_defaults_when_the_agent_ignores_them() -> None:
    """An agent started as a background job has SIGINT ignored, and an ignored signal stays
    ignored across exec: its sessions could not be interrupted. Now they can (and the agent
    still ignores it)."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sess = spawn(["bash", "-c", "trap 'echo got-int' INT; echo ready; sleep 10; echo after"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while b"ready" not in sess.ring.read(sess.ring.start, 1 << 16):
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        sess.send_signal("INT")
        out = await finished(sess)
        assert "got-int" in out, out
        os.kill(os.getpid(), signal.SIGINT)  # the agent itself still ignores it
        await asyncio.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_nul_in_the_environment_is_a_refusal_not_a_crash() -> None:
    with pytest.raises(SpawnError, match="cannot start"):
        spawn(["/bin/true"], env={"X": "a\x00b"})
    with pytest.raises(SpawnError, match="NUL"):
        spawn(["true"], env={"PATH": "/usr/bin\x00"})
