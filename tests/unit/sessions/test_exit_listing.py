"""A session's exit listing (`SessionExit.listing`) as the session layer takes it: an empty
listing is a listed empty directory (not "not listed"), a missing one is None (the files path
lists it), and more entries than an agent lists is not trusted as a listing."""

from __future__ import annotations

from agentic_sandbox.broker.agentlink import Exited
from agentic_sandbox.broker.sessions.contract import MAX_EXIT_LISTING
from agentic_sandbox.broker.sessions.trust import exit_status
from agentic_sandbox.proto import agent_pb2 as pb


def status_of(listing: pb.FileListing | None) -> tuple[str, ...] | None:
    msg = pb.SessionExit(session_id="s", end_offset=0, exit=pb.ExitInfo(has_code=True, code=0))
    if listing is not None:
        msg.listing.CopyFrom(listing)
    got = exit_status(Exited.from_pb(msg).exit).listing
    return None if got is None else tuple(e.name for e in got)


def entries(n: int) -> pb.FileListing:
    return pb.FileListing(
        entries=[pb.FileInfo(path=f"/o/f{i}", name=f"f{i}", type="file") for i in range(n)]
    )


def test_listed_empty_missing_and_too_many() -> None:
    assert status_of(None) is None
    assert status_of(pb.FileListing()) == ()  # listed, and empty: no stream needed
    assert status_of(entries(2)) == ("f0", "f1")
    assert status_of(entries(MAX_EXIT_LISTING)) is not None
    assert status_of(entries(MAX_EXIT_LISTING + 1)) is None
