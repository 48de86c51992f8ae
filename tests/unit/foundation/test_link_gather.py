"""`proto.gather`: what a sender of the agent link puts in one write — the first message
alone when nothing else is ready or it is large, else a batch in order within the bounds."""

from __future__ import annotations

from collections import deque

from agentic_sandbox.proto import BATCH_BYTES, BATCH_MESSAGES, gather
from agentic_sandbox.proto import agent_pb2 as pb


def _out(n: int, size: int = 10) -> deque[pb.AgentMessage]:
    return deque(
        pb.AgentMessage(output=pb.SessionOutput(session_id=str(i), data=b"x" * size))
        for i in range(n)
    )


def _batch(ready: list[pb.AgentMessage]) -> pb.AgentMessage:
    return pb.AgentMessage(batch=pb.AgentBatch(messages=ready))


def _take(q: deque[pb.AgentMessage]) -> pb.AgentMessage | None:
    return q.popleft() if q else None


def test_alone_when_nothing_else_is_ready() -> None:
    q = _out(1)
    first = q.popleft()
    assert gather(first, lambda: _take(q), _batch) is first


def test_a_burst_goes_in_order_and_stops_at_the_message_bound() -> None:
    q = _out(BATCH_MESSAGES + 5)
    sent = gather(q.popleft(), lambda: _take(q), _batch)
    ids = [m.output.session_id for m in sent.batch.messages]
    assert ids == [str(i) for i in range(BATCH_MESSAGES)]
    assert len(q) == 5  # left for the next write, none lost


def test_the_byte_bound_and_a_large_first_message() -> None:
    big = BATCH_BYTES // 4
    q = _out(10, big)
    sent = gather(q.popleft(), lambda: _take(q), _batch)
    n = len(sent.batch.messages)
    assert n == 4 and sent.ByteSize() < BATCH_BYTES + big + 64  # at most one past the bound
    q = _out(3, BATCH_BYTES)
    first = q.popleft()
    assert gather(first, lambda: _take(q), _batch) is first and len(q) == 2
