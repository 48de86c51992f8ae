"""A hostile agent: a real enrollment and a valid client certificate for its own instance, and
then crafted messages — ids that are paths, another instance's session ids, ids that are not
UUIDs or are huge, an inventory far over the session limit, impossible offsets, output and exits
for sessions it does not own.

What a user checks: nothing is written outside the data directory and nothing in it but files
named by real session ids; another owner's recordings and sessions are untouched and still
work; the instance gets no more sessions than its limit; the server stays healthy.

A real server subprocess, a real agent-client for the victim, and the crafted link
(`tests/support/crafted.py`) for the attacker. Loopback only.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from pathlib import Path

import pytest

from agentic_sandbox.broker.sessions.ids import is_session_id
from agentic_sandbox.proto import agent_pb2 as pb
from tests.support.agents import register_host_instance
from tests.support.crafted import CraftedAgent
from tests.support.fixtures import AgentFactory, ServerFactory
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import SHELL, create_session, events, metric, wait_state

pytestmark = pytest.mark.timeout(240)

CAP = 8  # SANDBOX_SESSION_MAX_PER_INSTANCE for this server
LOGGED_PER_LINK = 10  # refusals logged per link; the rest are only counted


def _inventory(sid: str, **kw: int) -> pb.SessionInventory:
    values = {"ring_start": 0, "end_offset": 0, "cols": 80, "rows": 24, **kw}
    return pb.SessionInventory(session_id=sid, state=pb.SESSION_STATE_RUNNING, **values)


def _recordings(server: ServerProcess) -> dict[str, str]:
    """Every file in the recordings directory, by name, with a hash of its content."""
    rec = server.data_dir / "recordings"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(rec.iterdir())}


def _files_outside(root: Path, inside: list[Path]) -> set[Path]:
    return {
        p for p in root.rglob("*") if p.is_file() and not any(p.is_relative_to(d) for d in inside)
    }


def _sessions(server: ServerProcess, instance_id: str) -> list[dict[str, object]]:
    out = server.ok("GET", f"/api/v2/admin/sessions?instance_id={instance_id}&limit=1000")
    items: list[dict[str, object]] = out["items"]
    return items


async def test_a_hostile_agent_is_confined_to_its_own_sessions(
    server_factory: ServerFactory, agent_factory: AgentFactory, tmp_path: Path
) -> None:
    server = server_factory(SANDBOX_SESSION_MAX_PER_INSTANCE=str(CAP))
    bob = server.make_token("bob", "operator")
    mallory = server.make_token("mallory", "operator")
    victim, evil = "victim-vm", "evil-vm"

    # ---- bob's instance, with a real agent: a live shell and a session that has ended
    register_host_instance(server, victim, token=bob)
    victim_agent = agent_factory(server, victim, register=False)
    live = create_session(server, victim, SHELL, token=bob)
    done = create_session(server, victim, ["sh", "-c", "echo finished"], token=bob)
    wait_state(server, done, ("exited",))
    async with await PtyClient.connect(
        server.ws_url, live, bob, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(b"echo victim-$((6*7))\r")
        await ctl.wait_output(b"victim-42")
        await ctl.wait_output(b"PROMPT> ")
    for sid in (live, done):  # (the download flushes a live recording first)
        assert server.api("GET", f"/api/v2/admin/sessions/{sid}/recording")[0] == 200
    live_end = server.ok("GET", f"/api/v2/admin/sessions/{live}")["output"]["end"]
    before = _recordings(server)
    # (the victim agent's own directories: its state, and the HOME its sessions run with)
    keep_out = [server.data_dir, victim_agent.state_dir, victim_agent.state_dir.parent / "home"]
    outside_before = _files_outside(tmp_path, keep_out)

    # ---- mallory's instance, driven by hand with its own valid certificate
    register_host_instance(server, evil, token=mallory)
    link = await CraftedAgent.enroll(server, evil, token=mallory)
    rec_dir = server.data_dir / "recordings"
    outside = tmp_path / "outside"
    in_tmp = Path("/tmp") / f"hostile-{uuid.uuid4().hex}"
    crafted_ids = [
        os.path.relpath(outside / "pwned", rec_dir),  # ../../outside/pwned
        str(outside / "absolute"),
        os.path.relpath(in_tmp / "pwned", rec_dir),
        f"../{live}",
        f"./{done}",
        f"{done}/../{live}",
        live.upper(),
        "{" + live + "}",
        f"urn:uuid:{live}",
        live.replace("-", ""),
        "not-a-uuid",
        "",
        "x" * 1_000_000,
    ]
    fresh = [str(uuid.uuid4()) for _ in range(150)]
    impossible = [str(uuid.uuid4()), str(uuid.uuid4())]
    inventory = [_inventory(sid) for sid in crafted_ids]
    inventory += [_inventory(live, end_offset=live_end), _inventory(done)]  # another's ids
    inventory += [_inventory(fresh[0], cols=2**31, rows=2**31)]
    inventory += [_inventory(sid) for sid in fresh[1:]]
    inventory += [
        _inventory(impossible[0], ring_start=10, end_offset=5),
        _inventory(impossible[1], end_offset=2**63),
    ]
    ack = await link.connect(pb.Register(instance_id=evil, sessions=inventory))

    resumed = [r.session_id for r in ack.resume]
    assert len(resumed) == CAP and set(resumed) <= set(fresh)
    told_to_end = set(ack.close)
    assert set(fresh) - set(resumed) <= told_to_end  # over the limit: told to end them
    assert {live, done, *impossible} <= told_to_end
    assert not set(crafted_ids) & (set(resumed) | told_to_end)  # malformed: never echoed

    # ---- messages for sessions it does not own, malformed ids, impossible offsets
    adopted, other = resumed[0], resumed[1]
    forged = b"FORGED-BY-EVIL"
    for sid in (live, done, *crafted_ids[:6], "x" * 100_000):
        await link.send(
            pb.AgentMessage(output=pb.SessionOutput(session_id=sid, offset=live_end, data=forged))
        )
        await link.send(pb.AgentMessage(opened=pb.SessionOpened(session_id=sid, ok=True)))
        await link.send(
            pb.AgentMessage(
                exit=pb.SessionExit(session_id=sid, exit=pb.ExitInfo(has_code=True, code=0))
            )
        )
    await link.send(
        pb.AgentMessage(output=pb.SessionOutput(session_id=adopted, offset=2**62, data=b"far"))
    )
    await link.send(
        pb.AgentMessage(output=pb.SessionOutput(session_id=adopted, offset=0, data=b"mine\r\n"))
    )
    await link.send(
        pb.AgentMessage(
            exit=pb.SessionExit(
                session_id=other, exit=pb.ExitInfo(signal="S" * 100_000, error="E" * 100_000)
            )
        )
    )
    await link.sync()

    # nothing outside the data directory, nothing in it but real session ids' files
    assert not outside.exists() and not in_tmp.exists()
    assert _files_outside(tmp_path, keep_out) == outside_before
    names = [p.name for p in rec_dir.iterdir()]
    assert all(
        re.fullmatch(r"[0-9a-f-]{36}\.cast(\.ckpt)?", n) and is_session_id(n[:36]) for n in names
    ), names
    # bob's recordings are byte for byte what they were; mallory's are new files
    after = _recordings(server)
    assert {n: after[n] for n in before} == before
    assert {n[:36] for n in set(after) - set(before)} == set(resumed)
    # bob's sessions: still his, the live one running and still working
    info = server.ok("GET", f"/api/v2/admin/sessions/{live}")
    assert (info["instance_id"], info["state"], info["output"]["end"]) == (
        victim,
        "running",
        live_end,
    )
    assert server.ok("GET", f"/api/v2/admin/sessions/{done}")["instance_id"] == victim
    async with await PtyClient.connect(
        server.ws_url, live, bob, role="control", from_offset=0
    ) as ctl:
        await ctl.send_input(b"echo still-$((6*7))\r")
        await ctl.wait_output(b"still-42")
        assert forged not in bytes(ctl.data)
    # mallory's instance: as many sessions as the limit, sizes within the protocol's
    rows = _sessions(server, evil)
    assert sorted(r["id"] for r in rows) == sorted(resumed)  # type: ignore[type-var]
    assert len(events(server, "session.adopted", instance_id=evil)) == CAP
    assert fresh[0] in resumed  # adopted in the agent's order, up to the limit
    big = server.ok("GET", f"/api/v2/admin/sessions/{fresh[0]}")
    assert (big["cols"], big["rows"]) == (1000, 500)
    mine = server.ok("GET", f"/api/v2/admin/sessions/{adopted}")
    assert mine["output"]["end"] == len(b"mine\r\n")  # its own output, not the far offset
    ended = wait_state(server, other, ("exited", "failed"))
    assert ended["exit_signal"] is None and len(ended["exit_reason"]) <= 2000
    # refusals are counted, and logged a bounded number of times
    for reason in ("bad-id", "not-owned", "over-cap", "bad-inventory", "bad-offset"):
        assert metric(server, "sandbox_agent_refusals_total", f'reason="{reason}"') > 0, reason
    log = server.log_text()
    assert log.count(f"agent {evil}: ") <= LOGGED_PER_LINK
    assert "x" * 200 not in log  # huge ids are cut in logs

    # ---- again, with an inventory of 20 000 more sessions than it may have
    still = [sid for sid in resumed if sid != other]
    flood = [str(uuid.uuid4()) for _ in range(20_000)]
    ack = await link.connect(
        pb.Register(instance_id=evil, sessions=[_inventory(s) for s in still + flood])
    )
    assert set(still) <= {r.session_id for r in ack.resume}
    assert len(ack.resume) == CAP  # the one that ended left room for one more
    assert len(ack.close) <= 10_000
    rows = _sessions(server, evil)
    assert sum(1 for r in rows if r["state"] in ("starting", "running", "killing")) == CAP
    assert len(rows) == CAP + 1
    await link.close()

    # ---- the server stays healthy
    assert server.alive() and server.api("GET", "/healthz")[0] == 200
    assert "Traceback" not in server.log_text()
    fresh_sid = create_session(server, victim, ["sh", "-c", "echo ok"], token=bob)
    wait_state(server, fresh_sid, ("exited",))
