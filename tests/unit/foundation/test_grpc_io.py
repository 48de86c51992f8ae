"""The server and the agent load gRPC with its polling I/O (`agentic_sandbox/proto/grpc_io.py`):
`GRPC_EXPERIMENTS` is read once, when `grpc` is imported, so the entry points must set it
before anything loads gRPC. Each check runs in a fresh interpreter and records the variable at
the moment `grpc` is first imported."""

from __future__ import annotations

import os
import subprocess
import sys

from agentic_sandbox.proto.grpc_io import ENV, POLLING_IO, use_polling_io

RECORD = """
import os, sys
seen = []
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_EXPERIMENTS"))
        return None
sys.meta_path.insert(0, Hook())
{BODY}
print(repr(seen))
"""


def _seen_at_grpc_import(body: str, **env: str) -> list[str | None]:
    clean = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", RECORD.replace("{BODY}", body)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )
    assert out.returncode == 0, out.stderr
    seen = eval(out.stdout.strip().splitlines()[-1])  # our own repr of a list of str/None
    assert isinstance(seen, list)
    return seen


def test_the_agent_loads_grpc_with_polling_io() -> None:
    seen = _seen_at_grpc_import(
        "import agentic_sandbox.agent.main\nimport agentic_sandbox.agent.runtime"
    )
    assert seen == [POLLING_IO]


def test_the_server_loads_grpc_with_polling_io(tmp_path: object) -> None:
    body = (
        "import contextlib, io\n"
        "from agentic_sandbox.broker.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['check-config']) == 0\n"
        "import agentic_sandbox.broker.agentlink.service"
    )
    assert _seen_at_grpc_import(body, SANDBOX_DATA_DIR=str(tmp_path)) == [POLLING_IO]


def test_an_operators_setting_is_kept() -> None:
    seen = _seen_at_grpc_import(
        "import agentic_sandbox.agent.main\nimport agentic_sandbox.agent.runtime",
        GRPC_EXPERIMENTS="",
    )
    assert seen == [""]
    env = {ENV: "event_engine_client"}
    assert use_polling_io(env) is False
    assert env == {ENV: "event_engine_client"}


def test_too_late_once_grpc_is_loaded() -> None:
    import grpc  # noqa: F401  (this test process has it loaded)

    env: dict[str, str] = {}
    assert use_polling_io(env) is False
    assert env == {}
