"""agent-client installs into a guest without the server's dependencies: importing it with
those packages unavailable works (import-linter checks the static imports; this checks the
real ones, including imports made by its dependencies)."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
BLOCKED = {BLOCKED}
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + '.') for b in BLOCKED):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import agentic_sandbox.agent.main
import agentic_sandbox.agent.runtime
import agentic_sandbox.agent.session
import agentic_sandbox.agent.pki
import agentic_sandbox.agent.config
import agentic_sandbox.agent.sysinfo
print('ok')
"""


def test_agent_imports_without_server_packages() -> None:
    blocked = {
        "aiohttp",
        "pydantic",
        "sqlalchemy",
        "cryptography",
        "pyte",
        "yaml",
        "uvloop",
        *(
            f"agentic_sandbox.{name}"
            for name in ("broker", "fleet", "images", "provision", "sandboxctl")
        ),
    }
    out = subprocess.run(
        [sys.executable, "-c", BLOCKER.replace("{BLOCKED}", repr(blocked))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
