"""The session hub in process: the output pipeline (redaction, ring offsets, recording, quiet
timer and HITL), control arbitration, exits and reconciliation, in seconds.

The process-level tests beside this file drive the same paths through a real server and real
agents; these drive the hub at its two edges (the agent link's typed values and a client
transport) with everything between them real (see `tests/support/inproc_hub.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from pathlib import Path

import pytest

from agentic_sandbox.broker.agentlink import Inventory
from agentic_sandbox.broker.auth.principal import Role
from agentic_sandbox.broker.sessions.contract import Prompt
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.broker.sessions.states import SessionState
from agentic_sandbox.proto import agent_pb2 as pb
from tests.support.inproc_hub import attach, hub_server, principal
from tests.support.polling import until

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cr3t-Value-42"
OUTPUT_BYTES = "sandbox_session_output_bytes_total"


def recorded_output(sess: HubSession) -> str:
    assert sess.recording is not None
    sess.recording.flush()
    lines = sess.recording.path.read_text().splitlines()[1:]  # after the header
    return "".join(ev[2] for ev in map(json.loads, lines) if ev[1] == "o")


async def test_output_reaches_the_ring_clients_recording_and_metrics_once(
    tmp_path: Path,
) -> None:
    async with hub_server(tmp_path) as hs:
        agent, sess = await hs.session("out-1")
        sid = sess.id
        assert sess.state == SessionState.running
        before = hs.metric(OUTPUT_BYTES)
        _, seen = attach(hs.hub, sess, principal("olga", Role.viewer))

        agent.output(sid, 0, b"hello ")
        agent.output(sid, 6, b"world\r\n")
        agent.output(sid, 3, b"lo world\r\nmore")  # resent from an older offset: only "more"
        agent.output(sid, 0, b"hello")  # all of it held already: dropped
        expected = b"hello world\r\nmore"
        await until(lambda: seen.output() == expected, "the client got all output")

        assert seen.frames[0][0] == 0
        assert (sess.ring.start, sess.ring.end) == (0, len(expected))
        assert hs.metric(OUTPUT_BYTES) - before == len(expected)
        assert recorded_output(sess) == expected.decode()
        ack = await agent.command("ack")  # the server holds the output: acknowledged
        assert (ack.ack.session_id, ack.ack.offset) == (sid, len(expected))
        hello = seen.of_type("hello")[0]
        assert (hello["role"], hello["from"], hello["state"]) == ("observer", 0, "running")
        await agent.close()


async def test_a_secret_printed_a_byte_at_a_time_never_shows(tmp_path: Path) -> None:
    async with hub_server(tmp_path, session_hitl_quiet_ms=20) as hs:
        agent, sess = await hs.session("red-1", secrets={"token": SECRET})
        sid = sess.id
        before = hs.metric(OUTPUT_BYTES)
        _, seen = attach(hs.hub, sess, principal("olga", Role.viewer))

        stream = b"key=" + SECRET.encode() + b" ok\r\n"
        for i in range(len(stream)):
            agent.output(sid, i, stream[i : i + 1])
            if i in (6, 9):
                await asyncio.sleep(0.1)  # pauses longer than the quiet time release nothing
                assert sess.ring.end == 4
        masked = b"key=" + b"*" * len(SECRET) + b" ok\r\n"
        await until(lambda: seen.output() == masked, "the masked output")

        # The stream ends inside what may be a secret's start: those bytes are masked, and go
        # the same way into the ring as any other output (counted, recorded, sent).
        tail = b"again " + SECRET.encode()[:5]
        agent.output(sid, len(stream), tail)
        assert sess.ring.end == len(stream) + len(b"again ")
        agent.exit(sid, len(stream) + len(tail), code=0)
        everything = masked + b"again *****"
        await until(lambda: seen.output() == everything, "the masked tail")
        assert hs.metric(OUTPUT_BYTES) - before == len(everything)
        assert recorded_output(sess) == everything.decode()
        assert SECRET.encode()[:3] not in seen.output()
        await agent.close()


async def test_a_gap_masks_what_was_held_and_continues_at_the_new_offset(
    tmp_path: Path,
) -> None:
    async with hub_server(tmp_path) as hs:
        agent, sess = await hs.session("gap-1", secrets={"token": SECRET})
        sid = sess.id
        agent.output(sid, 0, b"abc " + SECRET.encode()[:4])  # the last 4 bytes are held
        assert sess.ring.end == 4
        agent.output(sid, 1000, b"later\n")  # the agent's ring lost 8..1000
        assert (sess.ring.start, sess.ring.end) == (1000, 1006)
        assert sess.ring.read(1000, 6) == b"later\n"
        assert recorded_output(sess) == "abc ****later\n"  # and a gap marker in between
        await agent.close()


async def test_a_prompt_is_raised_once_output_is_quiet_and_only_once(tmp_path: Path) -> None:
    async with hub_server(tmp_path, session_hitl_quiet_ms=40) as hs:
        prompts: list[Prompt] = []
        hs.hub.add_prompt_listener(prompts.append)
        agent, sess = await hs.session("hitl-1")
        sid = sess.id

        agent.output(sid, 0, b"Are you sure? [y/N]\r\n")  # scrolls past: not a prompt
        agent.output(sid, 21, b"Overwrite file.txt? (y/n) ")
        await until(lambda: prompts, "a prompt")
        assert prompts == [
            Prompt(session_id=sid, text="Overwrite file.txt? (y/n)", offset=sess.ring.end)
        ]
        assert hs.metric("sandbox_hitl_prompts_total") == 1
        [event] = hs.published("session.prompt")
        assert event.data == {"text": "Overwrite file.txt? (y/n)", "offset": sess.ring.end}

        await asyncio.sleep(0.2)  # quiet again, no new output: not raised again
        agent.output(sid, sess.ring.end, b"y\r\ndone\r\n")
        await asyncio.sleep(0.2)
        assert len(prompts) == 1
        await agent.close()


async def test_one_controller_and_only_the_controller_reaches_the_pty(tmp_path: Path) -> None:
    async with hub_server(tmp_path) as hs:
        agent, sess = await hs.session("ctl-1")
        control = hs.hub.control
        alice, alice_seen = attach(
            hs.hub, sess, principal("admin"), want_control=True, may_control=True
        )
        bob, bob_seen = attach(hs.hub, sess, principal("bob"), want_control=True)
        carol, carol_seen = attach(
            hs.hub, sess, principal("carol", Role.admin), want_control=True, may_control=True
        )
        await until(lambda: carol_seen.of_type("error"), "carol's notice")
        assert sess.controller is alice and alice_seen.of_type("hello")[0]["role"] == "controller"
        assert [e["code"] for e in bob_seen.of_type("error")] == ["forbidden"]
        assert [e["code"] for e in carol_seen.of_type("error")] == ["control-held"]

        control.input(sess, bob, b"rm -rf /\r")  # an observer: refused, nothing sent
        control.resize(sess, bob, 100, 30)
        control.signal(sess, bob, "KILL")
        control.request(sess, bob, force=True)  # may not control at all
        await until(lambda: len(bob_seen.of_type("error")) == 5, "bob's refusals")
        assert [e["code"] for e in bob_seen.of_type("error")[1:]] == [
            "not-controller",
            "not-controller",
            "not-controller",
            "forbidden",
        ]
        assert not [c for c in await agent.commands() if c.WhichOneof("body") != "ack"]

        control.input(sess, alice, b"ls\r")
        assert (await agent.command("input")).input.data == b"ls\r"

        control.request(sess, carol, force=False)
        await until(lambda: len(carol_seen.of_type("error")) == 2, "control still held")
        control.request(sess, carol, force=True)
        assert sess.controller is carol
        await until(lambda: alice_seen.of_type("role"), "alice told")
        assert alice_seen.of_type("role")[-1]["role"] == "observer"
        assert "taken by carol" in alice_seen.of_type("role")[-1]["reason"]

        control.resize(sess, carol, 100, 30)
        resize = (await agent.command("resize")).resize
        assert (resize.cols, resize.rows) == (100, 30)
        await until(
            lambda: all(s.of_type("resize") for s in (alice_seen, bob_seen, carol_seen)),
            "everyone told the new size",
        )
        assert (sess.cols, sess.rows) == (100, 30)
        control.signal(sess, carol, "INT")
        assert (await agent.command("signal")).signal.signal == pb.SIGNAL_INT

        control.release(sess, carol)
        assert sess.controller is None
        control.request(sess, alice, force=False)
        assert sess.controller is alice
        control.detach(sess, alice)  # a controller that goes away releases the lease
        assert sess.controller is None
        assert hs.published("session.control")[-1].data == {
            "controller": None,
            "reason": "controller disconnected",
        }
        await agent.close()


async def test_the_exit_follows_the_last_output_and_the_agent_is_told_to_forget(
    tmp_path: Path,
) -> None:
    async with hub_server(tmp_path) as hs:
        agent, sess = await hs.session("exit-1")
        sid = sess.id
        _, seen = attach(hs.hub, sess, principal("olga", Role.viewer))
        agent.output(sid, 0, b"bye\r\n")
        agent.exit(sid, 5, code=3)
        status = await hs.hub.wait_exit(sid)
        assert (status.code, status.lost) == (3, False)
        await until(lambda: seen.closed is not None, "the client closed")
        assert seen.output() == b"bye\r\n"
        assert seen.texts[-1] == {
            "type": "exit",
            "code": 3,
            "signal": None,
            "lost": False,
            "reason": "",
            "offset": 5,
        }
        assert seen.closed == (1000, "session ended")
        assert (await agent.command("close")).close.session_id == sid
        assert sess.state == SessionState.exited
        await agent.close()


async def test_registration_adopts_within_the_cap_and_drops_what_is_not_the_agents(
    tmp_path: Path,
) -> None:
    async with hub_server(tmp_path, session_max_per_instance=2) as hs:
        unknown = [str(uuid.uuid4()) for _ in range(3)]
        inventory = [
            Inventory(sid, running=True, ring_start=0, end_offset=10, cols=90, rows=30)
            for sid in unknown
        ]
        inventory.append(Inventory("../../etc/passwd", running=True, ring_start=0, end_offset=1))
        inventory.append(Inventory(str(uuid.uuid4()), running=True, ring_start=5, end_offset=1))
        agent = await hs.agent("adopt-1", register=False)
        answer = await agent.register(inventory)

        assert [r.session_id for r in answer.resume] == unknown[:2]  # adopted, to the cap
        assert all(r.from_offset == 0 for r in answer.resume)
        assert answer.close == [inventory[4].session_id, unknown[2]]  # impossible, over the cap
        assert "../../etc/passwd" not in answer.close
        assert len(hs.published("session.adopted")) == 2
        for reason in ("bad-id", "bad-inventory", "over-cap"):
            assert hs.metric("sandbox_agent_refusals_total", reason=reason) == 1
        adopted = hs.hub.get(unknown[0])
        assert adopted is not None and (adopted.cols, adopted.rows) == (90, 30)

        # Output for a session of another instance is not this agent's: refused, not applied.
        other = await hs.agent("adopt-2")
        other.output(unknown[0], 0, b"not yours")
        assert adopted.ring.end == 0
        assert hs.metric("sandbox_agent_refusals_total", reason="not-owned") == 1
        await other.close()
        await agent.close()


def _fill_disk_under(path: Path) -> None:
    """From now on, writes to the open file at `path` fail as on a full disk (ENOSPC): its
    descriptor is pointed at /dev/full."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                    os.dup2(full, int(fd))
                    return
    finally:
        os.close(full)
    raise AssertionError(f"{path} is not open")


async def test_a_recording_that_cannot_be_written_does_not_stop_the_sweep(
    tmp_path: Path,
) -> None:
    async with hub_server(tmp_path, session_retain_seconds=0) as hs:
        agent, sess = await hs.session("full-1")
        assert sess.recording is not None
        _fill_disk_under(sess.recording.path)
        agent.output(sess.id, 0, b"x" * 4096)  # buffered; every flush of it fails
        agent.exit(sess.id, 4096)
        await until(lambda: hs.hub.get(sess.id) is None, "the ended session evicted")

        # the sweep goes on: the next ended session is evicted too
        agent2, sess2 = await hs.session("full-2")
        agent2.exit(sess2.id, 0)
        await until(lambda: hs.hub.get(sess2.id) is None, "the next ended session evicted")
        await agent2.close()
        await agent.close()
