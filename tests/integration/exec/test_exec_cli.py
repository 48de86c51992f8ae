"""`sandboxctl instance exec` against a real server and host agent: the command's stdout and
stderr on the terminal's own streams, its exit status, stdin, a budget's reason on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fixtures import AgentFactory, unique_id
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]


def sandboxctl(
    server: ServerProcess, *args: str, stdin: bytes = b"", home: Path
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
    env.update(
        {
            "SANDBOX_URL": server.url,
            "SANDBOX_TOKEN": server.admin_token,
            "XDG_CONFIG_HOME": str(home),
        }
    )
    return subprocess.run(
        [sys.executable, "-m", "agentic_sandbox.sandboxctl.main", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def test_instance_exec_behaves_like_the_command(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    iid = agent_factory(sandbox_server, unique_id("x1-cli")).instance_id
    done = sandboxctl(
        sandbox_server,
        "instance",
        "exec",
        iid,
        "--",
        "sh",
        "-c",
        "printf 'out\\000bin'; echo err >&2; exit 5",
        home=tmp_path,
    )
    assert done.returncode == 5, done.stderr
    assert done.stdout == b"out\x00bin" and done.stderr == b"err\n"

    done = sandboxctl(
        sandbox_server,
        "instance",
        "exec",
        iid,
        "--stdin",
        "--",
        "tr",
        "a-z",
        "A-Z",
        stdin=b"shout\n",
        home=tmp_path,
    )
    assert (done.returncode, done.stdout) == (0, b"SHOUT\n")

    done = sandboxctl(
        sandbox_server,
        "instance",
        "exec",
        iid,
        "--timeout",
        "0.5",
        "--",
        "sleep",
        "30",
        home=tmp_path,
    )
    assert done.returncode == 128 + 9
    assert b"ended: timeout" in done.stderr

    done = sandboxctl(
        sandbox_server, "instance", "exec", iid, "--", "no-such-program-x1", home=tmp_path
    )
    assert done.returncode == 6 and b"body.argv" in done.stderr  # invalid input

    done = sandboxctl(sandbox_server, "instance", "exec", iid, home=tmp_path)
    assert done.returncode == 2 and b"after --" in done.stderr
