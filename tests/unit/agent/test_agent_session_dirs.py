"""`OpenSession.make_dirs`: the agent makes a session's directories (a task's working directory
and outbox) as it opens it, with the checks of a `file_mkdir` stream; one it cannot make fails
the open with an error naming it, and nothing is started."""

from __future__ import annotations

import argparse
import os
import pwd
from pathlib import Path

import pytest

from agentic_sandbox.agent.config import load, parser
from agentic_sandbox.agent.runtime import MAX_SESSION_DIRS, AgentRuntime
from agentic_sandbox.proto import agent_pb2 as pb
from tests.unit.agent.test_agent_identity import make_config


def runtime(tmp_path: Path) -> AgentRuntime:
    args: argparse.Namespace = parser().parse_args(["--config", str(make_config(tmp_path))])
    return AgentRuntime(load(args))


def test_the_registration_says_it_makes_session_dirs(tmp_path: Path) -> None:
    assert runtime(tmp_path).register_message().session_dirs


def test_dirs_are_made_with_their_parents_and_again_is_fine(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    outbox = tmp_path / "tasks" / "t1" / "outbox"
    rt._make_dirs([str(outbox)], "")
    assert outbox.is_dir() and outbox.parent.is_dir()
    (outbox / "left.txt").write_text("kept")
    rt._make_dirs([str(outbox)], "")  # a resent open: what is there stays
    assert (outbox / "left.txt").read_text() == "kept"


def open_error(rt: AgentRuntime, dirs: list[str], user: str = "") -> str:
    out = rt._open(pb.OpenSession(session_id="s-dirs", command=["true"], make_dirs=dirs, user=user))
    assert not out.opened.ok and "s-dirs" not in rt.sessions
    return out.opened.error


def test_a_dir_that_cannot_be_made_fails_the_open_naming_it(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    (tmp_path / "file").write_text("x")
    assert "relative/outbox" in open_error(rt, ["relative/outbox"])
    assert f"{tmp_path}/file" in open_error(rt, [f"{tmp_path}/file/outbox"])
    assert "/../" not in str(tmp_path)
    assert ".." in open_error(rt, [f"{tmp_path}/a/../b"])
    many = [f"{tmp_path}/d{i}" for i in range(MAX_SESSION_DIRS + 1)]
    assert f"at most {MAX_SESSION_DIRS}" in open_error(rt, many)
    assert not (tmp_path / "d0").exists()


def test_the_dirs_belong_to_the_sessions_user(tmp_path: Path) -> None:
    """As a `file_mkdir` with the session's user as owner: the asked user's ids (parents it
    made too); no user, the agent's default ids."""
    rt = runtime(tmp_path)
    mine = tmp_path / "mine" / "outbox"
    rt._make_dirs([str(mine)], "")
    assert (mine.stat().st_uid, mine.parent.stat().st_uid) == (os.getuid(), os.getuid())
    if os.geteuid() != 0:
        return  # giving directories away needs root (the guest's agent runs as root)
    nobody = pwd.getpwnam("nobody")
    theirs = tmp_path / "theirs" / "outbox"
    rt._make_dirs([str(theirs)], "nobody")
    assert theirs.stat().st_uid == theirs.parent.stat().st_uid == nobody.pw_uid


def test_a_failing_chown_is_a_refusal_not_a_broken_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError while making them (here chown, as in a user namespace without the uid)
    fails that open, naming the path; it does not escape into the link."""
    rt = runtime(tmp_path)

    def no_chown(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", no_chown)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the agent believes it may give them away
    monkeypatch.setattr(os, "getuid", lambda: 0)
    error = open_error(rt, [f"{tmp_path}/x/outbox"], user="nobody")
    assert f"{tmp_path}/x" in error and "permission" in error.lower(), error
