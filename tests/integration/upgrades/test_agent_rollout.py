"""Agent upgrades over the agent link (`broker/upgrades`, `agent/upgrade.py`): an admin
uploads a bundle and rolls it out; each host agent's session keeper starts a worker on it and
keeps it once it links and hears the server, else goes back, naming why. Sessions live on
through either, byte for byte."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from agentic_sandbox.provision.bundle import MANIFEST, build_bundle, pack_bundle
from agentic_sandbox.sdk import AsyncClient, NotFound, ValidationFailed
from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory, ServerFactory
from tests.support.ptyclient import PtyClient
from tests.support.sessions import create_session, first_difference
from tests.support.upgrades import repack, roll_out, upload

pytestmark = pytest.mark.timeout(300)

FLOOD_SERVER = {
    "SANDBOX_SESSION_RING_BYTES": str(32 * 1024 * 1024),
    "SANDBOX_SESSION_CLIENT_MAX_LAG_BYTES": str(24 * 1024 * 1024),
}
MAIN = "agentic_sandbox/agent/main.py"


def worker_env(agent: AgentProcess) -> dict[str, str]:
    raw = Path(f"/proc/{agent.worker_pid()}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


async def test_a_rollout_during_a_flood_loses_no_byte_and_the_agent_reports_the_new_version(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    server = server_factory(**FLOOD_SERVER)
    agent = agent_factory(server)
    before = server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")
    assert before["agent_bundle"] == ""  # the installed agent (the checkout)
    status, bundle = upload(server, repack("9.9.9+rollout-test"))
    assert status == 201, bundle
    assert bundle["version"] == "9.9.9+rollout-test" and not bundle["builtin"]
    assert upload(server, repack("9.9.9+rollout-test"))[0] == 200  # the same bytes: kept once
    listed = server.ok("GET", "/api/v2/admin/agent-bundles")["items"]
    assert listed[0]["builtin"] and bundle["digest"] in [b["digest"] for b in listed]

    out = tmp_path / "pty-output.txt"  # the PTY's output, byte for byte
    pidfile = tmp_path / "shell.pid"
    stop = tmp_path / "stop"  # the flood goes on until the rollout is over
    cmd = [
        "sh",
        "-c",
        f"echo $$ > {pidfile}; stty -opost -echo; sleep 0.5; "
        f"while [ ! -e {stop} ]; do seq 1 20000; sleep 0.02; done | tee {out}; "
        "echo FLOOD-DONE; while read l; do echo got:$l:$$; done",
    ]
    sid = create_session(server, agent.instance_id, cmd)
    first_worker = agent.worker_pid()
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, from_offset=0
    ) as watcher:
        await watcher.wait_offset(1_500_000, timeout=60)
        rollout_at = len(watcher.data)
        op = await asyncio.to_thread(
            roll_out,
            server,
            {"bundle": bundle["digest"], "instances": [agent.instance_id], "trial_seconds": 60},
        )
        assert op["state"] == "succeeded", op
        assert len(watcher.data) > rollout_at + 100_000  # the flood went on through it
        stop.touch()
        (outcome,) = op["result"]["instances"]
        assert outcome["state"] == "upgraded", outcome
        assert outcome["sessions_kept"] == 1 and outcome["version"] == "9.9.9+rollout-test"
        await watcher.wait_output(b"FLOOD-DONE", timeout=120)
        assert not watcher.resyncs, f"resynced: {watcher.resyncs[:1]}"
        async with await PtyClient.connect(
            server.ws_url, sid, server.admin_token, role="control"
        ) as ctl:
            await ctl.send_input(b"again\n")
            pid = pidfile.read_text().strip()
            await watcher.wait_output(f"got:again:{pid}".encode(), timeout=30)  # the same shell
        got = bytes(watcher.data)
    expected = out.read_bytes()
    assert hashlib.sha256(got[: len(expected)]).hexdigest() == (
        hashlib.sha256(expected).hexdigest()
    ), f"the observer's output differs from the PTY's: {first_difference(got, expected)}"

    after = server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")
    assert after["agent_version"] == "9.9.9+rollout-test"
    assert after["agent_bundle"] == bundle["digest"] and after["bundle_problem"] == ""
    assert agent.worker_pid() != first_worker and agent.alive()  # the keeper stayed
    bundles = agent.state_dir / "bundles"
    assert worker_env(agent)["PYTHONPATH"].split(":")[0] == str(bundles / bundle["digest"])
    assert (bundles / "current").readlink().name == bundle["digest"]
    assert server.ok("GET", f"/api/v2/admin/sessions/{sid}")["state"] == "running"
    again = await asyncio.to_thread(
        roll_out, server, {"bundle": bundle["digest"], "instances": [agent.instance_id]}
    )
    (outcome,) = again["result"]["instances"]
    assert (outcome["state"], outcome["reason"]) == ("skipped", "it runs this bundle already")


async def test_a_bundle_whose_worker_fails_is_rolled_back_naming_why_and_keeps_the_sessions(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    agent = agent_factory(server)
    source = (Path(__file__).resolve().parents[3] / MAIN).read_text()
    broken = source.replace(
        "    args = parser().parse_args(argv)\n",
        "    sys.exit(3)  # a worker that cannot start\n    args = parser().parse_args(argv)\n",
        1,
    )
    assert broken != source
    status, bundle = upload(server, repack("6.6.6", {MAIN: broken.encode()}))
    assert status == 201, bundle  # it imports: only running it shows what is wrong
    sid = create_session(
        server, agent.instance_id, ["sh", "-c", "while read l; do echo got:$l; done"]
    )
    op = await asyncio.to_thread(
        roll_out,
        server,
        {"bundle": bundle["digest"], "instances": [agent.instance_id], "trial_seconds": 30},
    )
    assert op["state"] == "failed", op
    assert agent.instance_id in op["error"]["cause"], op["error"]
    (outcome,) = op["error"]["instances"]
    assert outcome["state"] == "rolled-back", outcome
    assert bundle["digest"] in outcome["reason"] and "exited (3)" in outcome["reason"]
    status_now = server.ok("GET", f"/api/v2/admin/agents/{agent.instance_id}")
    assert status_now["state"] == "connected" and status_now["agent_bundle"] == ""
    assert bundle["digest"] in status_now["bundle_problem"]
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(b"still-here\n")
        await ctl.wait_output(b"got:still-here", timeout=30)
    audit = server.ok("GET", f"/api/v2/admin/audit?subject_id={agent.instance_id}")["items"]
    assert any(a["action"] == "agent.upgrade" and a["outcome"] == "failed" for a in audit), audit


def test_what_a_rollout_cannot_do_is_named(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    plain = agent_factory(server, extra_args=["--no-session-keeper"])
    op = roll_out(server, {"instances": [plain.instance_id]})  # the server's own bundle
    assert op["state"] == "succeeded", op
    (outcome,) = op["result"]["instances"]
    assert outcome["state"] == "skipped" and "session keeper" in outcome["reason"], outcome

    status, problem = upload(server, b"not a bundle")
    assert status == 422 and problem["errors"][0]["field"] == "body", problem
    status, problem = upload(server, pack_bundle([(MANIFEST, b'{"version": "1"}')]))
    assert status == 422 and "does not import" in problem["detail"], problem
    operator = server.make_token("ops", "operator")
    assert upload(server, build_bundle(), token=operator)[0] == 403
    status, problem = server.api("POST", "/api/v2/admin/agent-rollouts", {"bundle": "0" * 64})
    assert status == 404 and "body.bundle" in problem["detail"], problem
    status, problem = server.api(
        "POST", "/api/v2/admin/agent-rollouts", {"instances": ["no-such-instance"]}
    )
    assert status == 404 and "no-such-instance" in problem["detail"], problem
    status, problem = server.api("POST", "/api/v2/admin/agent-rollouts", {"trial_seconds": 1})
    assert status == 422 and problem["errors"][0]["field"] == "body.trial_seconds", problem


async def test_the_sdk_uploads_lists_and_rolls_out(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory()
    agent = agent_factory(server)
    async with AsyncClient(server.url, server.admin_token) as c:
        up = await c.agents.upload_bundle(repack("7.7.7+sdk"))
        assert (up.version, up.builtin, up.created_by) == ("7.7.7+sdk", False, "token:admin")
        assert (await c.agents.upload_bundle(repack("7.7.7+sdk"))).digest == up.digest
        digests = [b.digest for b in await c.agents.bundles()]
        assert digests[1:] == [up.digest] and len(digests[0]) == 64  # the server's own first
        op = await c.operations.wait(
            await c.agents.rollout(bundle=up.digest, instances=[agent.instance_id]),
            timeout=120,
        )
        assert op.state == "succeeded" and op.result is not None, op
        assert op.result["instances"][0]["state"] == "upgraded", op.result
        assert (await c.agents.get(agent.instance_id)).agent_version == "7.7.7+sdk"
        with pytest.raises(ValidationFailed) as bad:
            await c.agents.upload_bundle(b"not a bundle")
        assert list(bad.value.fields) == ["body"], bad.value
        with pytest.raises(NotFound):
            await c.agents.rollout(bundle="f" * 64)
