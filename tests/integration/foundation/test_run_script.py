"""Command one (`scripts/run.sh`) as a user runs it: it brings the server up and prints where it
is and the admin token; run again while that server runs, it says so and prints the same, and
starts no second server."""

from __future__ import annotations

import subprocess
import time
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
        # the first run's banner, and the token its background check prints once the server
        # answers /readyz (every 0.2 s): on a loaded machine that line may come a moment after
        # our own /readyz did, so read the console as a user would, until it is there
        deadline = time.monotonic() + 30
        first = server.log_text()
        while not ("agentic-sandbox server is up" in first and token in first):
            assert time.monotonic() < deadline, first[-3000:]
            time.sleep(0.2)
            first = server.log_text()
    finally:
        server.stop()
    assert not server.alive()
