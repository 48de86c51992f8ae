"""`OpenSession.make_dirs`: the agent makes a session's directories (a task's working directory
and outbox) as it opens it, with the checks of a `file_mkdir` stream; one it cannot make fails
the open with an error naming it, and nothing is started."""

from __future__ import annotations

import argparse
from pathlib import Path

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


def open_error(rt: AgentRuntime, dirs: list[str]) -> str:
    out = rt._open(pb.OpenSession(session_id="s-dirs", command=["true"], make_dirs=dirs))
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
