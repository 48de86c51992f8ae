"""Streams share the link fairly with sessions: a keystroke's echo in an interactive session
still arrives while an exec floods its output through the same agent link."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.integration.exec.helpers import run
from tests.support.fixtures import AgentFactory, unique_id
from tests.support.polling import wait_until
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import create_session

pytestmark = pytest.mark.timeout(180)


async def test_a_keystroke_echo_arrives_while_an_exec_floods_the_link(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    server = sandbox_server
    agent = agent_factory(server, unique_id("x1-fair"))
    sid = create_session(server, agent.instance_id, ["cat"])
    flag = tmp_path / "flooding"
    result: dict[str, Any] = {}

    def flood() -> None:
        result["answer"] = run(
            server,
            agent.instance_id,
            {
                "argv": ["sh", "-c", f"echo > {flag}; exec cat /dev/zero"],
                "stdout_limit_bytes": 0,  # the server counts and drops it
                "budget": {"timeout_seconds": 12},
            },
        )

    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        wait_until(flag.exists, "the flood started")
        for i in range(5):
            key = f"key-{i}\r".encode()
            await ctl.send_input(key)
            await ctl.wait_output(f"key-{i}".encode(), timeout=30)
            assert thread.is_alive(), "the flood ended before the echo arrived"
        thread.join(60)
    status, answer = result["answer"]
    assert status == 200 and answer["reason"] == "timeout", answer
    # the flood really went through the link meanwhile (what the agent read, credit-bound)
    assert answer["stdout"]["bytes"] > 20 * 1024 * 1024, answer["stdout"]
    assert answer["stdout"]["truncated"] and answer["stdout"]["data"] == ""
