"""Session admin routes, screen, recording, HITL prompts, secret redaction, agents, metrics."""

from __future__ import annotations

import json
import time

import pytest
from openapi_spec_validator import validate

from tests.support.fixtures import AgentFactory, unique_id
from tests.support.polling import until, wait_until
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import SHELL, create_session, events, metric, wait_state

pytestmark = pytest.mark.timeout(180)


async def test_screen_list_get_and_recording(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL, name="work", cols=90, rows=20)
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(
            b"for i in $(seq 1 40); do echo line-$i; done; printf '\\033[1;31mred\\033[0m\\n'\r"
        )
        await ctl.wait_output(b"line-40")
        await ctl.wait_output(b"red")
        screen_url = f"/api/v2/admin/sessions/{sid}/screen?scrollback=50"
        # the screen is the server's emulator: it has the bytes once it shows the last line
        await until(lambda: "red" in server.ok("GET", screen_url)["text"], "red on the screen", 15)
        screen = server.ok("GET", screen_url)
        assert (screen["cols"], screen["rows"]) == (90, 20)
        assert len(screen["lines"]) == 20
        assert "line-40" in screen["text"] and "red" in screen["text"]
        assert "line-40" in screen["lines"][screen["cursor"]["y"] - 2]
        assert any(ln == "line-5" for ln in screen["scrollback"])
        # A new client gets that screen at once (a snapshot with the colours), then live.
        async with await PtyClient.connect(server.ws_url, sid, server.admin_token) as late:
            snap = await late.wait_control("resync")
            assert snap["reason"] == "initial" and "line-40" in snap["screen"]
            assert "\x1b[0;31m" in snap["screen"] or "\x1b[0;1;31m" in snap["screen"]
        await ctl.send_input(b"exit 0\r")
        await ctl.wait_control("exit")

    items = server.ok("GET", f"/api/v2/admin/sessions?instance_id={agent.instance_id}")["items"]
    assert [i["id"] for i in items] == [sid]
    info = server.ok("GET", f"/api/v2/admin/sessions/{sid}")
    assert info["name"] == "work" and info["state"] == "exited" and info["exit_code"] == 0
    assert info["output"]["end"] > 0 and info["recording"]

    status, body = server.api("GET", f"/api/v2/admin/sessions/{sid}/recording")
    assert status == 200
    lines = (body if isinstance(body, bytes) else json.dumps(body).encode()).decode().splitlines()
    header = json.loads(lines[0])
    assert header["version"] == 2 and (header["width"], header["height"]) == (90, 20)
    out = "".join(json.loads(ln)[2] for ln in lines[1:] if json.loads(ln)[1] == "o")
    assert "line-40" in out and "red" in out
    times = [json.loads(ln)[0] for ln in lines[1:]]
    assert times == sorted(times)


async def test_hitl_prompt_raises_an_event_and_answer_goes_through(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    script = 'read -p "Delete everything? [y/N] " a; echo "answer=$a"'
    sid = create_session(server, agent.instance_id, ["bash", "-c", script])
    deadline = time.monotonic() + 15
    found: list[dict[str, object]] = []
    while not found and time.monotonic() < deadline:
        found = events(server, "session.prompt", session_id=sid)
        time.sleep(0.1)
    assert found, "no session.prompt event"
    assert "[y/N]" in str(found[0]["data"]["text"])  # type: ignore[index]
    assert metric(server, "sandbox_hitl_prompts_total") >= 1
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(b"y\r")
        await ctl.wait_output(b"answer=y")
        await ctl.wait_control("exit")
    # Ordinary output that scrolls by is not a prompt.
    sid2 = create_session(
        server, agent.instance_id, ["sh", "-c", "echo 'are you sure? no.'; sleep 1"]
    )
    wait_state(server, sid2, ("exited",))
    assert not events(server, "session.prompt", session_id=sid2)


async def test_secrets_are_redacted_from_streams_recordings_and_events(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    secret = "s3cr3t-" + unique_id("v")
    server.ok(
        "PUT",
        f"/api/v2/admin/secrets/{unique_id('API_KEY').replace('-', '_')}",
        {"value": secret, "instances": [agent.instance_id], "env_name": "API_KEY"},
    )
    # The secret reaches the session as an environment variable; printing it (whole, and
    # split across two writes with a pause) never shows it to anyone.
    half = len(secret) // 2
    script = (
        'printf "key=%s\\n" "$API_KEY"; '
        f"printf '%s' '{secret[:half]}'; sleep 0.02; printf '%s\\n' '{secret[half:]}'; "
        'printf "prompt: %s (y/n) " "$API_KEY"; sleep 2'
    )
    sid = create_session(server, agent.instance_id, ["bash", "-c", script])
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, from_offset=0
    ) as obs:
        await obs.wait_control("exit", timeout=20)
        data = bytes(obs.data)
    assert b"key=" + b"*" * len(secret) in data
    assert secret.encode() not in data
    assert data.count(b"*" * len(secret)) >= 3
    status, rec = server.api("GET", f"/api/v2/admin/sessions/{sid}/recording")
    assert status == 200
    assert secret.encode() not in (rec if isinstance(rec, bytes) else json.dumps(rec).encode())
    for ev in events(server, "session.", session_id=sid):
        assert secret not in json.dumps(ev)
    assert secret not in server.log_text()
    screen = server.ok("GET", f"/api/v2/admin/sessions/{sid}/screen")
    assert secret not in json.dumps(screen)


async def test_agents_api_metrics_and_openapi(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    wait_until(  # the first heartbeat brings the metrics (0.5 s apart in tests)
        lambda: server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")["metrics"],
        "the agent's first heartbeat",
    )
    status = server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")
    assert status["state"] == "connected"
    m = status["metrics"]
    assert m["memory_total_bytes"] > 0 and m["disk_total_bytes"] > 0
    assert 0 <= m["cpu_percent"] <= 100 and m["load1"] >= 0
    listed = {a["instance_id"] for a in server.ok("GET", "/api/v2/admin/agents")["items"]}
    assert agent.instance_id in listed
    status_code, ca = server.api("GET", "/api/v2/admin/agent-link/ca")
    assert status_code == 200 and b"BEGIN CERTIFICATE" in ca
    # Agent-side 503 for an instance without an agent, 404 for an unknown one.
    lonely = unique_id("lonely")
    server.ok("POST", "/api/v2/admin/agents/host-instances", {"instance_id": lonely})
    code, problem = server.api("POST", "/api/v2/admin/sessions", {"instance_id": lonely})
    assert code == 503 and problem["status"] == 503
    code, _ = server.api("POST", "/api/v2/admin/sessions", {"instance_id": "no-such-instance"})
    assert code == 404
    code, _ = server.api("POST", "/api/v2/admin/agents/host-instances", {"instance_id": lonely})
    assert code == 409
    code, problem = server.api(
        "POST", "/api/v2/admin/sessions", {"instance_id": lonely, "cwd": "relative/path"}
    )
    assert code == 422 and problem["errors"][0]["field"] == "body.cwd"
    code, problem = server.api(
        "POST", "/api/v2/admin/sessions", {"instance_id": lonely, "env": {"X": "a\x00b"}}
    )
    assert code == 422 and problem["errors"][0]["field"] == "body.env", problem

    sid = create_session(server, agent.instance_id, SHELL)
    async with await PtyClient.connect(server.ws_url, sid, server.admin_token, role="control"):
        text = server.api("GET", "/metrics")[1].decode()
        for family in (
            'sandbox_agents{state="connected"}',
            'sandbox_session_clients{role="controller"}',
            'sandbox_sessions{state="running"}',
            "sandbox_session_output_bytes_total",
            "sandbox_session_relayed_bytes_total",
            'sandbox_grpc_messages_total{direction="in",kind="heartbeat"}',
            'sandbox_agent_link_events_total{event="connected"}',
        ):
            assert family in text, family
    server.ok("POST", f"/api/v2/admin/sessions/{sid}/kill")

    doc = server.ok("GET", "/api/openapi.json")
    validate(doc)
    for path in (
        "/api/v2/admin/sessions",
        "/api/v2/admin/sessions/{session_id}",
        "/api/v2/admin/sessions/{session_id}/attach",
        "/api/v2/admin/sessions/{session_id}/screen",
        "/api/v2/admin/sessions/{session_id}/recording",
        "/api/v2/admin/sessions/{session_id}/kill",
        "/api/v2/admin/agents/host-instances",
        "/api/v2/admin/instances/{instance_id}/enrollment-tokens",
    ):
        assert path in doc["paths"], path
    attach = doc["paths"]["/api/v2/admin/sessions/{session_id}/attach"]["get"]
    assert "101" in attach["responses"]
    assert {p["name"] for p in attach["parameters"]} >= {"session_id", "role", "from"}
