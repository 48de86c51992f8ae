"""The SDK against a real server process with real host agents: instances through the
host-instance route, sessions whose output is lossless by offset across a dropped
connection, input and resize, events by cursor and live, tasks, agent cards, problem+json
as exceptions that name the field, and the models against the server's OpenAPI document."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentic_sandbox import AsyncClient, Client
from agentic_sandbox.sdk import (
    Conflict,
    ConnectionFailed,
    Contexts,
    Forbidden,
    NotController,
    NotFound,
    Output,
    RateLimited,
    SignatureInvalid,
    Unauthorized,
    UnknownContext,
    ValidationFailed,
    models,
)
from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.relay import CuttingRelay
from tests.support.server import ServerProcess, free_port


@pytest.fixture
async def sbx(sandbox_server: ServerProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(sandbox_server.url, sandbox_server.admin_token) as client:
        yield client


async def ended(sbx: AsyncClient, session_id: str) -> None:
    deadline = time.monotonic() + 60
    while (await sbx.sessions.get(session_id)).state == "running":
        assert time.monotonic() < deadline, "the session did not end"
        await asyncio.sleep(0.1)


def contiguous(chunks: list[Output], start: int = 0) -> bytes:
    """The bytes of `chunks`, asserting each starts where the one before ended."""
    at = start
    for chunk in chunks:
        assert chunk.offset == at, (chunk.offset, at)
        at = chunk.end
    return b"".join(c.data for c in chunks)


async def test_a_host_instance_becomes_ready(
    sandbox_server: ServerProcess, sbx: AsyncClient, tmp_path: Path
) -> None:
    iid = unique_id("sdk-host")
    lint = {"id": "lint", "name": "Lint", "description": "Runs the linter", "runner": ["true"]}
    with pytest.raises(ValidationFailed) as bad:
        await sbx.instances.register_host(iid, skills=[{**lint, "runs": ["x"]}])
    assert "body.skills.0.runs" in str(bad.value.fields), bad.value
    record = await sbx.instances.register_host(
        iid, description="sdk test", skills=[lint], task_runner={"argv": ["sh", "-c", "{text}"]}
    )
    assert record.id == iid and record.kind == "host-agent" and record.agent_state == "absent"
    card = sandbox_server.ok("GET", f"/agents/{iid}/.well-known/agent-card.json", token="")
    assert {s["id"] for s in card["skills"]} == {"shell", "lint"}
    with pytest.raises(Conflict) as exc:
        await sbx.instances.register_host(iid)
    assert exc.value.status == 409 and exc.value.code == "instance-exists"
    enroll = await sbx.instances.enrollment_token(iid)
    agent = AgentProcess(
        sandbox_server, iid, tmp_path / "agent", enrollment_token=enroll.token
    ).start()
    try:
        inst = await sbx.instances.wait_ready(iid, timeout=60)
        assert inst.ready and inst.agent_state == "connected" and inst.kind == "host-agent"
        assert (await sbx.agents.get(iid)).state == "connected"
        assert iid in {i.id for i in await sbx.instances.list()}
        # the sync client says the same, also called from inside a running event loop
        with Client(sandbox_server.url, sandbox_server.admin_token) as sync:
            assert sync.instances.get(iid).ready
            assert sync.whoami() == await sbx.whoami()
    finally:
        agent.stop()


async def test_attach_resumes_losslessly_after_a_dropped_connection(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(sandbox_server)
    session = await sbx.sessions.create(agent.instance_id, ["seq", "-f", "line-%g", "1", "30000"])
    await ended(sbx, session.id)
    expected = b"".join(b"line-%d\r\n" % i for i in range(1, 30001))
    relay = await CuttingRelay(sandbox_server.http_port, cut_after=60_000).start()
    try:
        async with (
            AsyncClient(relay.url, sandbox_server.admin_token) as through_relay,
            through_relay.sessions.attach(session.id, from_offset=0) as term,
        ):
            chunks = [chunk async for chunk in term]
        assert relay.cuts == 1 and term.connects == 2  # cut once, reattached once
        assert contiguous(chunks) == expected  # no byte lost, none twice
        assert term.exit is not None and term.exit.code == 0 and term.resyncs == []
    finally:
        await relay.stop()
    # the sync client reads the same stream
    with (
        Client(sandbox_server.url, sandbox_server.admin_token) as sync,
        sync.sessions.attach(session.id, from_offset=len(expected) - 12) as tail,
    ):
        assert b"".join(chunk.data for chunk in tail) == b"line-30000\r\n"


async def test_a_live_session_survives_cuts(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(sandbox_server)
    script = "for i in $(seq 1 300); do echo live-$i; sleep 0.01; done"
    session = await sbx.sessions.create(agent.instance_id, ["bash", "-c", script])
    relay = await CuttingRelay(sandbox_server.http_port).start()
    try:
        async with AsyncClient(relay.url, sandbox_server.admin_token) as c:
            chunks: list[Output] = []
            async with c.sessions.attach(session.id, from_offset=0, role="observe") as term:
                async for chunk in term:
                    chunks.append(chunk)
                    if len(chunks) in (2, 6, 12):  # cut while the session is still writing
                        relay.cut_all()
        assert relay.cuts == 3 and term.connects >= 2
        assert contiguous(chunks) == b"".join(b"live-%d\r\n" % i for i in range(1, 301))
        assert term.exit is not None and term.exit.code == 0
    finally:
        await relay.stop()


async def test_input_resize_and_roles(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(sandbox_server)
    session = await sbx.sessions.create(agent.instance_id, ["bash", "--norc", "--noprofile"])

    async def read_until(term: object, needle: bytes) -> bytes:
        seen = b""
        async for chunk in term:  # type: ignore[attr-defined]
            seen += chunk.data
            if needle in seen:
                return seen
        raise AssertionError(f"{needle!r} never came: {seen[-300:]!r}")

    async with (
        sbx.sessions.attach(session.id) as ctl,
        sbx.sessions.attach(session.id, role="observe") as obs,
    ):
        assert ctl.role == "controller" and obs.role == "observer"
        await ctl.resize(101, 33)
        await ctl.send("stty size; echo $((6*7))-typed\r")
        assert b"33 101" in await asyncio.wait_for(read_until(ctl, b"42-typed"), 60)
        assert b"42-typed" in await asyncio.wait_for(read_until(obs, b"42-typed"), 60)
        with pytest.raises(NotController):
            await obs.send(b"echo never\r")
        screen = await sbx.sessions.screen(session.id)
        assert (screen.cols, screen.rows) == (101, 33) and "42-typed" in screen.text
        await sbx.sessions.kill(session.id)
        async for _ in obs:  # to its exit
            pass
        assert obs.exit is not None
    assert (await sbx.sessions.get(session.id)).state != "running"
    assert b'"o"' in await sbx.sessions.recording(session.id)  # asciicast output events


async def test_events_by_cursor_and_live(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(sandbox_server)
    first = await sbx.events.page(after=0, limit=2)
    assert len(first.items) == 2 and first.next == first.items[-1].seq
    second = await sbx.events.page(after=first.next, limit=2)
    assert second.items[0].seq > first.next
    every = [ev.seq async for ev in sbx.events.iter(after=0)]
    assert every == sorted(set(every)) and every[:4] == [e.seq for e in first.items + second.items]
    assert every[-1] == (await sbx.events.page(limit=1)).last_seq

    relay = await CuttingRelay(sandbox_server.http_port).start()
    try:
        async with AsyncClient(relay.url, sandbox_server.admin_token) as c:
            now = (await sbx.events.page(limit=1)).last_seq
            stream = c.events.follow(after=now, types="session.*", instance_id=agent.instance_id)
            made = []
            seen: list[models.Event] = []
            for _ in range(2):
                s = await sbx.sessions.create(agent.instance_id, ["true"])
                made.append(s.id)
                while True:
                    ev = await asyncio.wait_for(anext(stream), 60)
                    seen.append(ev)
                    if ev.type == "session.created" and ev.session_id == s.id:
                        break
                relay.cut_all()  # the second event must come through a new connection
            await stream.aclose()  # type: ignore[attr-defined]
        assert relay.connections >= 2
        seqs = [e.seq for e in seen]
        assert seqs == sorted(set(seqs)), seqs  # nothing twice, in order
        created = [e.session_id for e in seen if e.type == "session.created"]
        assert created == made
    finally:
        await relay.stop()


async def test_tasks(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(sandbox_server)
    task = await sbx.tasks.send(agent.instance_id, "echo from-sdk-$((40+2)); exit 3")
    assert task.instance_id == agent.instance_id
    done = await sbx.tasks.wait(task.id, timeout=60)
    assert done.state == "failed" and done.exit_code == 3
    assert done.runs and done.runs[0].exit_code == 3
    assert [t.to_state for t in done.transitions][-1] == "failed"
    logs = [log async for log in sbx.tasks.logs(task.id)]
    assert "from-sdk-42" in "".join(str(log.data.get("text", "")) for log in logs)
    assert logs[-1].kind == "end" and logs[-1].data["exit_code"] == 3
    page = await sbx.tasks.list(instance_id=agent.instance_id)
    assert task.id in {t.id for t in page.items} and page.totals.get("failed", 0) >= 1
    slow = await sbx.tasks.send(agent.instance_id, "sleep 60")
    await sbx.tasks.cancel(slow.id)
    assert (await sbx.tasks.wait(slow.id, timeout=60)).state == "canceled"


async def test_agent_card_verifies_and_a_tampered_one_does_not(
    sandbox_server: ServerProcess, sbx: AsyncClient, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(sandbox_server)
    verified = await sbx.agentcards.verify(agent.instance_id)
    jwks = await sbx.agentcards.jwks(agent.instance_id)
    assert verified.kid in {k["kid"] for k in jwks["keys"]} and verified.header["alg"] == "EdDSA"
    card = await sbx.agentcards.get(agent.instance_id)
    with pytest.raises(SignatureInvalid, match="does not verify"):
        await sbx.agentcards.verify(agent.instance_id, {**card, "version": "9.9.9"})
    with pytest.raises(SignatureInvalid, match="no signatures"):
        await sbx.agentcards.verify(agent.instance_id, {**card, "signatures": []})


async def test_refusals_are_exceptions_that_name_the_field(
    sandbox_server: ServerProcess,
    sbx: AsyncClient,
    agent_factory: AgentFactory,
    server_factory: ServerFactory,
) -> None:
    with pytest.raises(NotFound) as nf:
        await sbx.instances.get("no-such-vm")
    assert nf.value.status == 404 and nf.value.code == "instance-not-found"
    assert "no-such-vm" in str(nf.value)
    with pytest.raises(ValidationFailed) as bad:
        await sbx.secrets.set("9bad", "x" * 8)
    assert set(bad.value.fields) == {"path.name"}
    with pytest.raises(ValidationFailed) as bad:
        await sbx.sessions.create("Not An Id!", ["true"], cols=0)
    assert {"body.instance_id", "body.cols"} <= set(bad.value.fields), bad.value.fields
    agent = agent_factory(sandbox_server)
    with pytest.raises(Conflict, match="agent on the host"):
        await sbx.instances.start(agent.instance_id)
    viewer = (await sbx.tokens.create("sdk-viewer", role="viewer")).token
    async with AsyncClient(sandbox_server.url, viewer) as as_viewer:
        assert (await as_viewer.whoami()).role == "viewer"
        with pytest.raises(Forbidden, match="operator role"):
            await as_viewer.secrets.set("SDK_SECRET", "x" * 8)
    async with AsyncClient(sandbox_server.url, "sbx_wrong") as wrong:
        with pytest.raises(Unauthorized):
            await wrong.whoami()
    async with AsyncClient(f"http://127.0.0.1:{free_port()}", "t") as nowhere:
        with pytest.raises(ConnectionFailed, match="cannot reach"):
            await nowhere.whoami()
    limited = server_factory(SANDBOX_RATE_LIMIT_PER_MINUTE="6", SANDBOX_RATE_LIMIT_BURST="2")
    async with AsyncClient(limited.url, limited.admin_token) as c:
        with pytest.raises(RateLimited) as slow:
            for _ in range(20):
                await c.whoami()
    assert slow.value.status == 429 and slow.value.retry_after and slow.value.retry_after > 0


async def test_tokens_and_secrets(sandbox_server: ServerProcess, sbx: AsyncClient) -> None:
    created = await sbx.tokens.create("sdk-ops", role="operator", description="from the SDK")
    assert created.token.startswith("sbx_") and created.role == "operator"
    listed = {t.id: t for t in await sbx.tokens.list()}
    assert created.id in listed and "token" not in listed[created.id].to_dict()
    await sbx.tokens.revoke(created.id)
    async with AsyncClient(sandbox_server.url, created.token) as revoked:
        with pytest.raises(Unauthorized):
            await revoked.whoami()
    info = await sbx.secrets.set("SDK_SECRET", "s3cret-value", env_name="SDK_SECRET")
    assert info.name == "SDK_SECRET" and "s3cret-value" not in str(info.to_dict())
    secrets = await sbx.secrets.list()
    assert "SDK_SECRET" in {s.name for s in secrets}
    assert "s3cret-value" not in str([s.to_dict() for s in secrets])
    await sbx.secrets.delete("SDK_SECRET")
    with pytest.raises(NotFound):
        await sbx.secrets.delete("SDK_SECRET")


async def test_contexts_like_the_cli(
    sandbox_server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SANDBOX_URL", "SANDBOX_TOKEN", "SANDBOX_CONTEXT", "SANDBOX_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    ctxs = Contexts.load()
    ctxs.set("lab", sandbox_server.url, sandbox_server.admin_token, None)
    ctxs.save()
    async with AsyncClient() as c:  # the current context: its URL and token file
        assert c.url == sandbox_server.url and (await c.whoami()).role == "admin"
    with pytest.raises(UnknownContext):
        AsyncClient(context="nope")


async def test_models_match_the_openapi_document(sbx: AsyncClient) -> None:
    doc = await sbx._transport.request("GET", "/api/openapi.json")
    schemas = doc["components"]["schemas"]
    checked = []
    for _, cls in inspect.getmembers(models, inspect.isclass):
        if not issubclass(cls, models.ApiModel) or not cls.__schema__:
            continue
        schema = schemas[cls.__schema__]
        fields = set(cls.model_fields)
        assert fields <= set(schema["properties"]), (
            cls.__name__,
            fields - set(schema["properties"]),
        )
        required = {n for n, f in cls.model_fields.items() if f.is_required()}
        assert required <= set(schema.get("required", [])), (cls.__name__, required)
        checked.append(cls.__name__)
    assert len(checked) >= 30, checked
