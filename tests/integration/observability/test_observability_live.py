"""Observability of a live server with real agents and sessions: bounded label sets with 200
sessions, a valid exposition after a busy scenario, audit entries for a controller takeover and
a denial, and secrets kept out of events, audit and logs."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict

from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def exposition(server: ServerProcess) -> str:
    status, text = server.api("GET", "/metrics")
    assert status == 200
    return text.decode() if isinstance(text, bytes) else str(text)


def label_values(text: str) -> dict[str, dict[str, set[str]]]:
    """family → label name → the set of values seen."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" not in line:
            continue
        name, _, rest = line.partition("{")
        labels = rest.rsplit("}", 1)[0]
        for pair in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels):
            out[name][pair[0]].add(pair[1])
    return out


def run_sessions(server: ServerProcess, agent: AgentProcess, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        sess = server.ok(
            "POST",
            "/api/v2/admin/sessions",
            {"instance_id": agent.instance_id, "command": ["true"]},
        )
        ids.append(sess["id"])
    return ids


def test_200_sessions_do_not_grow_label_sets(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    before = label_values(exposition(server))
    run_sessions(server, agent, 200)
    text = exposition(server)
    after = label_values(text)
    assert UUID_RE.search(text) is None, "a session id leaked into a label"
    assert agent.instance_id not in text, "an instance id leaked into a label"
    for family, labels in after.items():
        for label, values in labels.items():
            grown = len(values) - len(before.get(family, {}).get(label, set()))
            assert grown < 20, f"{family}{{{label}}} grew by {grown} values"
            assert len(values) < 100, f"{family}{{{label}}} has {len(values)} values"
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert re.search(r"^sandbox_session_output_bytes_total \d", text, re.M)


async def test_takeover_and_denial_are_audited_and_secrets_stay_out(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    secret = "obs-secret-value-7731"
    server.ok(
        "PUT",
        "/api/v2/admin/secrets/OBS_TOKEN",
        {"value": secret, "instances": [agent.instance_id], "env_name": "OBS_TOKEN"},
    )
    sess = server.ok(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": agent.instance_id, "command": ["bash", "--norc"]},
    )
    operator = server.make_token("olga", "admin")
    async with await PtyClient.connect(
        server.ws_url, sess["id"], server.admin_token, role="control"
    ) as first:
        await first.send_input(b'echo "value=$OBS_TOKEN"\r')
        await first.wait_output(b"value=")
        async with await PtyClient.connect(
            server.ws_url, sess["id"], operator, role="observe"
        ) as second:
            await second.send_json({"type": "request_control", "force": True})
            await second.wait_control("role", timeout=10)
    viewer = server.make_token("vic", "viewer")
    status, _ = server.api("POST", f"/api/v2/admin/sessions/{sess['id']}/kill", {}, token=viewer)
    assert status == 403
    audit = server.ok("GET", "/api/v2/admin/audit?limit=1000")["items"]
    assert any(
        a["subject_id"] == sess["id"] and "control" in a["action"] and "olga" in a["actor"]
        for a in audit
    ), [a["action"] for a in audit][-20:]
    assert any(a["outcome"] == "denied" and "vic" in a["actor"] for a in audit)
    events = server.ok("GET", "/api/v1/events?limit=200&type=session.*")
    for where in (str(audit), str(events), server.log_text()):
        assert secret not in where
