"""`OpenSession.list_on_exit`: when the session's process has ended, the agent lists that
directory (a task's outbox) into its `SessionExit.listing`, as a `file_list` stream would (by
name, symlinks not followed), so the server needs no stream after the run. A directory it
cannot list, or one with more than `EXIT_LIST_LIMIT` entries, gives no listing (the server then
lists it with a stream, which names the error); a resent exit carries the same listing."""

from __future__ import annotations

import argparse
import asyncio
import shlex
from pathlib import Path

from agentic_sandbox.agent.config import load, parser
from agentic_sandbox.agent.files import EXIT_LIST_LIMIT
from agentic_sandbox.agent.runtime import AgentRuntime
from agentic_sandbox.proto import agent_pb2 as pb
from tests.unit.agent.test_agent_identity import make_config


def runtime(tmp_path: Path) -> AgentRuntime:
    args: argparse.Namespace = parser().parse_args(["--config", str(make_config(tmp_path))])
    return AgentRuntime(load(args))


async def exit_of(
    rt: AgentRuntime, script: str, outbox: Path, *, listed: bool = True
) -> pb.SessionExit:
    """Run `script` in a session that makes `outbox` and (with `listed`) lists it on exit."""
    sid = f"s-{len(rt.sessions)}"
    opened = rt._open(
        pb.OpenSession(
            session_id=sid,
            command=["sh", "-c", script],
            make_dirs=[str(outbox)],
            list_on_exit=str(outbox) if listed else "",
        )
    )
    assert opened.opened.ok, opened.opened.error
    sess = rt.sessions[sid]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while loop.time() < deadline:
        msg, _ = sess.next_message(loop.time())
        if msg is None:
            await asyncio.sleep(0.02)
        elif msg.WhichOneof("body") == "exit":
            assert msg.exit.exit.code == 0, msg.exit
            return msg.exit
    raise AssertionError("the session did not exit")


async def test_the_outbox_comes_back_with_the_exit(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    outbox = tmp_path / "task" / "outbox"
    script = (
        f"cd {shlex.quote(str(outbox))} && printf hello > b.txt && mkdir sub "
        "&& ln -s /etc/passwd a-link && printf x > c.bin"
    )
    ended = await exit_of(rt, script, outbox)
    assert ended.HasField("listing") and not ended.listing.truncated
    got = [(e.name, e.type, e.path) for e in ended.listing.entries]
    assert got == [
        ("a-link", "symlink", f"{outbox}/a-link"),
        ("b.txt", "file", f"{outbox}/b.txt"),
        ("c.bin", "file", f"{outbox}/c.bin"),
        ("sub", "directory", f"{outbox}/sub"),
    ]
    by_name = {e.name: e for e in ended.listing.entries}
    assert by_name["b.txt"].size == 5 and by_name["a-link"].link_target == "/etc/passwd"
    # a new link asks for the exit again: the same listing, not a new look
    (outbox / "later.txt").write_text("after the exit was sent")
    sess = rt.sessions["s-0"]
    sess.resume_from(0)
    loop = asyncio.get_running_loop()
    again = None
    while again is None:
        msg, _ = sess.next_message(loop.time())
        assert msg is not None
        if msg.WhichOneof("body") == "exit":
            again = msg.exit
    assert again.listing == ended.listing


async def test_no_listing_when_not_asked_too_many_or_gone(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    plain = await exit_of(rt, "true", tmp_path / "t1" / "outbox", listed=False)
    assert not plain.HasField("listing")
    many = tmp_path / "t2" / "outbox"
    crowd = await exit_of(
        rt, f"cd {shlex.quote(str(many))} && touch $(seq 1 {EXIT_LIST_LIMIT + 1})", many
    )
    assert not crowd.HasField("listing")  # the server lists it with a stream
    exactly = tmp_path / "t3" / "outbox"
    full = await exit_of(
        rt, f"cd {shlex.quote(str(exactly))} && touch $(seq 1 {EXIT_LIST_LIMIT})", exactly
    )
    assert len(full.listing.entries) == EXIT_LIST_LIMIT
    gone = tmp_path / "t4" / "outbox"
    removed = await exit_of(rt, f"rmdir {shlex.quote(str(gone))}", gone)
    assert not removed.HasField("listing")
    # an outbox the run replaced with a symlink is not followed (no listing of its target)
    swapped = tmp_path / "t5" / "outbox"
    q = shlex.quote(str(swapped))
    relinked = await exit_of(rt, f"rmdir {q} && ln -s /etc {q}", swapped)
    assert not relinked.HasField("listing")
