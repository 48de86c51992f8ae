"""Exec through the SDK against a real server and host agent: the JSON answer (exit code,
output, a budget's reason and usage), the streaming form's events in order, the blocking
twin, and a refusal naming the field."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import pytest

from agentic_sandbox import AsyncClient, Client
from agentic_sandbox.sdk import NotFound, ValidationFailed
from tests.support.fixtures import AgentFactory, unique_id
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def sbx(sandbox_server: ServerProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(sandbox_server.url, sandbox_server.admin_token) as client:
        yield client


async def test_exec_answers_and_streams(
    sandbox_server: ServerProcess, agent_factory: AgentFactory, sbx: AsyncClient
) -> None:
    iid = agent_factory(sandbox_server, unique_id("sdk-exec")).instance_id

    done = await sbx.instances.exec(
        iid, ["sh", "-c", "echo out; echo err >&2; cat; exit 3"], stdin=b"from stdin\n"
    )
    assert done.exit_code == 3 and done.signal is None and done.reason is None
    assert done.stdout.data == "out\nfrom stdin\n" and done.stderr.data == "err\n"
    assert done.instance_id == iid and done.usage.output_bytes == len("out\nfrom stdin\nerr\n")

    ended = await sbx.instances.exec(iid, ["sleep", "30"], timeout_seconds=0.5)
    assert ended.reason == "timeout" and ended.exit_code is None and ended.signal
    assert ended.budget.timeout_seconds == 0.5

    kinds: list[str] = []
    out = b""
    async for line in sbx.instances.exec_stream(iid, ["sh", "-c", "printf 'a\\000b'; exit 7"]):
        kinds.append(line["type"])
        if line["type"] == "stdout":
            out += base64.b64decode(line["data"])
        if line["type"] == "exit":
            assert line["exit_code"] == 7
    assert kinds[0] == "started" and kinds[-1] == "exit" and out == b"a\x00b"

    with Client(sandbox_server.url, sandbox_server.admin_token) as sync:
        assert sync.instances.exec(iid, ["true"]).exit_code == 0
        assert [ln["type"] for ln in sync.instances.exec_stream(iid, ["true"])][-1] == "exit"

    with pytest.raises(ValidationFailed) as bad:
        await sbx.instances.exec(iid, ["true"], cwd="relative/path")
    assert "body.cwd" in bad.value.fields
    with pytest.raises(NotFound):
        await sbx.instances.exec(unique_id("sdk-nobody"), ["true"])
