"""Secrets printed slowly — one character per write, pauses longer than any quiet time — stay
masked in every stream, the recording and the screen; offsets stay those of the PTY's output.

Two secrets share a long prefix and start with repeated characters; two sessions print at the
same time on one agent; one output ends in the middle of a secret.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.support.fixtures import AgentFactory, unique_id
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import create_session, wait_state

pytestmark = pytest.mark.timeout(180)

# `slow PAUSE TEXT`: one character per write, 0.15 s apart (each write arrives alone, with
# quiet longer than the hub's flush delays between them), after a pause.
SLOW = (
    'slow() { sleep "$1"; s="$2"; '
    'for ((i=0; i<${#s}; i++)); do printf %s "${s:i:1}"; sleep 0.15; done; }'
)


def _script(first: str, second: str) -> str:
    return (
        f"{SLOW}; "
        'printf "A:"; slow 0 "$FIRST"; printf "\\n"; '  # slowly, right after other output
        'printf "B:"; slow 0.3 "$SECOND"; printf "\\n"; '  # slowly, after a pause
        'printf "C:%s" "${SECOND:0:5}"; sleep 0.3; printf "%s\\n" "${SECOND:5}"; '  # split
        f'printf "D:"; slow 0 "${{SECOND:0:{len(second) - 1}}}"'  # ends inside a secret
    )


def _expected(first: str, second: str) -> bytes:
    return b"\r\n".join(
        [
            b"A:" + b"*" * len(first),
            b"B:" + b"*" * len(second),
            b"C:" + b"*" * len(second),
            b"D:" + b"*" * (len(second) - 1),
        ]
    )


def _recorded_output(server: ServerProcess, sid: str) -> str:
    status, body = server.api("GET", f"/api/v2/admin/sessions/{sid}/recording")
    assert status == 200
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = raw.decode().splitlines()[1:]
    return "".join(str(e[2]) for e in map(json.loads, lines) if e[1] == "o")


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def test_slow_split_and_interleaved_secrets_are_masked(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    tag = unique_id("k").replace("-", "")
    first = f"aaab{tag}-first"
    second = f"aaab{tag}-second"  # shares "aaab<tag>-" with the first
    for env_name, value in (("FIRST", first), ("SECOND", second)):
        server.ok(
            "PUT",
            f"/api/v2/admin/secrets/{env_name}_{tag}",
            {"value": value, "instances": [agent.instance_id], "env_name": env_name},
        )
    script = _script(first, second)
    sids = [create_session(server, agent.instance_id, ["bash", "-c", script]) for _ in range(2)]
    observers = [
        await PtyClient.connect(server.ws_url, sid, server.admin_token, from_offset=0)
        for sid in sids
    ]
    try:
        await asyncio.gather(*(o.wait_control("exit", timeout=60) for o in observers))
        streams = [bytes(o.data) for o in observers]
    finally:
        for o in observers:
            await o.close()
    expected = _expected(first, second)
    for sid, data in zip(sids, streams, strict=True):
        assert data == expected  # masked, same length, nothing lost or added
        info = wait_state(server, sid, ("exited",))
        assert info["output"]["end"] == len(expected)
        assert _recorded_output(server, sid) == expected.decode()
        screen = json.dumps(server.ok("GET", f"/api/v2/admin/sessions/{sid}/screen"))
        assert "aaab" + tag not in screen
    for secret in (first, second):
        assert not _files_holding(server.data_dir, secret.encode())
    assert ("aaab" + tag) not in server.log_text()
