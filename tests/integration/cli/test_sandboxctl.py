"""sandboxctl against a real server: tables and JSON, meaningful exit codes, sessions and
tasks on a real host-side agent, and raw-mode attach through a real PTY."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import Sandboxctl
from tests.support.fixtures import AgentFactory
from tests.support.server import ServerProcess

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def ctl(sandbox_server: ServerProcess, tmp_path: Path) -> Sandboxctl:
    return Sandboxctl(sandbox_server.url, sandbox_server.admin_token, tmp_path / "cli")


def test_help_and_usage_errors(ctl: Sandboxctl) -> None:
    res = ctl("--help")
    assert res.returncode == 0 and "instance" in res.stdout and "Exit codes" in res.stdout
    res = ctl("instance")
    assert res.returncode == 2 and "VERB" in res.stderr
    res = ctl("session", "attach", "x", "--detach-key", "alt-x")
    assert res.returncode == 2 and "--detach-key" in res.stderr


def test_tokens_secrets_and_exit_codes(ctl: Sandboxctl) -> None:
    res = ctl("whoami", "-o", "json")
    assert res.returncode == 0 and json.loads(res.stdout)["role"] == "admin"
    res = ctl("token", "create", "--subject", "cli-user", "--role", "viewer")
    assert res.returncode == 0, res.stderr
    viewer = res.stdout.strip()
    assert viewer.startswith("sbx_") and "shown once" in res.stderr
    listing = ctl("token", "list")
    assert "cli-user" in listing.stdout and viewer not in listing.stdout
    assert "SUBJECT" in listing.stdout.splitlines()[0]  # a table by default
    res = ctl("secret", "set", "CLI_SECRET", "v@lue-123", token=viewer)
    assert res.returncode == 4 and "operator role" in res.stderr
    res = ctl("secret", "set", "CLI_SECRET", "v@lue-123")
    assert res.returncode == 0 and "v@lue-123" not in res.stdout
    res = ctl("secret", "set", "9bad", "x" * 8)
    assert res.returncode == 6 and "path.name" in res.stderr
    res = ctl("session", "get", "nope")
    assert res.returncode == 2  # no such verb
    res = ctl("session", "kill", "00000000-0000-0000-0000-000000000000")
    assert res.returncode == 3, res.stderr
    res = ctl("whoami", token="sbx_wrong")
    assert res.returncode == 4 and "invalid" in res.stderr
    assert ctl("instance", "list").returncode == 0  # the table, empty
    res = ctl("instance", "create", "vm-1", "--no-wait")
    assert res.returncode == 7 and "disabled" in res.stderr  # this server runs no fleet


def test_contexts(sandbox_server: ServerProcess, tmp_path: Path) -> None:
    """A context saved once is what later calls use: no URL or token in the environment."""
    s = sandbox_server
    ctl = Sandboxctl("", None, tmp_path / "ctx")  # neither $SANDBOX_URL nor $SANDBOX_TOKEN
    res = ctl("config", "set-context", "lab", "--server", s.url, "--token", s.admin_token, "--use")
    assert res.returncode == 0, res.stderr
    token_file = ctl.home / "agentic-sandbox" / "tokens" / "lab"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert s.admin_token not in (ctl.home / "agentic-sandbox" / "sandboxctl.yaml").read_text()
    listing = ctl.json("config", "get-contexts")["items"]
    assert [(c["current"], c["name"], c["url"]) for c in listing] == [("*", "lab", s.url)]
    assert ctl.json("whoami")["role"] == "admin"  # through the context's URL and token file
    res = ctl("whoami", "--context", "nope")
    assert res.returncode == 2 and "unknown context 'nope'" in res.stderr, res.stderr


def test_sessions_tasks_and_events(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, ctl: Sandboxctl
) -> None:
    s = sandbox_server
    agent = agent_factory(s)
    res = ctl(
        "session",
        "new",
        agent.instance_id,
        "-o",
        "json",
        "--",
        "bash",
        "-c",
        "echo cli-session-ok; sleep 30",
    )
    assert res.returncode == 0, res.stderr
    sid = json.loads(res.stdout)["id"]
    deadline = time.monotonic() + 20
    while "cli-session-ok" not in (screen := ctl("session", "screen", sid).stdout):
        assert time.monotonic() < deadline, screen
        time.sleep(0.3)
    assert sid in ctl("session", "list", "--instance", agent.instance_id).stdout
    assert ctl("session", "kill", sid).returncode == 0
    res = ctl("task", "send", agent.instance_id, "echo task-from-cli", "-o", "json")
    assert res.returncode == 0, res.stderr
    task_id = json.loads(res.stdout)["id"]
    deadline = time.monotonic() + 30
    while json.loads(ctl("task", "get", task_id, "-o", "json").stdout)["state"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert task_id in ctl("task", "list", "--instance", agent.instance_id).stdout
    events = ctl("event", "tail", "--type", "session.*", "--limit", "200")
    assert "session." in events.stdout


def test_attach_is_a_real_terminal(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    """Drive `sandboxctl session attach` through a PTY (as a person would) and detach."""
    import ptyprocess as pexpect  # the agent's own dependency, always installed

    s = sandbox_server
    agent = agent_factory(s)
    sid = s.ok(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": agent.instance_id, "command": ["bash", "--norc"]},
    )["id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update(
        {"SANDBOX_URL": s.url, "SANDBOX_TOKEN": s.admin_token, "XDG_CONFIG_HOME": str(tmp_path)}
    )
    proc = pexpect.PtyProcess.spawn(
        [sys.executable, "-m", "agentic_sandbox.sandboxctl.main", "session", "attach", sid],
        env=env,
        cwd=str(tmp_path),
        dimensions=(30, 100),
    )
    out = b""
    try:
        deadline = time.monotonic() + 20
        while b"attached" not in out and time.monotonic() < deadline:
            out += proc.read(4096)
        proc.write(b"echo $((40+2))-via-attach\r")
        while b"42-via-attach" not in out and time.monotonic() < deadline:
            out += proc.read(4096)
        assert b"42-via-attach" in out
        proc.write(b"\x1d")  # Ctrl-]
        while proc.isalive() and time.monotonic() < deadline:
            try:
                out += proc.read(4096)
            except EOFError:
                break
        proc.wait()
        assert proc.exitstatus == 0, out[-500:]
        assert b"detached" in out
    finally:
        if proc.isalive():
            proc.kill(9)
    assert s.ok("GET", f"/api/v2/admin/sessions/{sid}")["state"] == "running"
