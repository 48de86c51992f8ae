"""Command one (`scripts/run.sh`) as a user runs it: it brings the server up and prints where it
is and the admin token; run again while that server runs, it says so and prints the same, and
starts no second server."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.server import ROOT, ServerProcess


def test_command_one_again_while_its_server_runs_points_at_it(tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "data", {"SANDBOX_LOG_FORMAT": "text"}, argv=["bash", "scripts/run.sh"]
    )
    env = server.environment()
    try:
        server.start(timeout=180)
        server.wait_ready()
        token = (server.data_dir / "admin-token").read_text().strip()

        again = subprocess.run(
            ["bash", "scripts/run.sh"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stdout, again.stdout
        assert f"http://127.0.0.1:{server.http_port}/" in again.stdout
        assert token in again.stdout
        assert server.alive(), "the second run disturbed the first server"
        first = server.log_text()
        assert "agentic-sandbox server is up" in first and token in first
    finally:
        server.stop()
    assert not server.alive()
