"""The output rings (server and agent): offsets, wrap-around, growth, overwrite, frames."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_sandbox.agent.ring import Ring
from agentic_sandbox.broker.sessions.ring import OutputRing, pack_frame, unpack_frame


def test_server_ring_wraps_and_keeps_the_last_capacity_bytes() -> None:
    ring = OutputRing(10)
    ring.append(b"abcdefgh")
    ring.append(b"ijkl")
    assert (ring.start, ring.end) == (2, 12)
    assert ring.read(2, 100) == b"cdefghijkl"
    assert ring.read(5, 3) == b"fgh"
    assert ring.tail(4) == b"ijkl"
    with pytest.raises(ValueError):
        ring.read(1, 5)
    ring.append(b"0123456789ABC")  # larger than the ring
    assert (ring.start, ring.end) == (15, 25)
    assert ring.read(15, 10) == b"3456789ABC"


def test_server_ring_frames_carry_the_offset() -> None:
    ring = OutputRing(8, base=1000)
    ring.append(b"hello world")
    frame = ring.frame(ring.start, 100)
    offset, data = unpack_frame(frame)
    assert offset == 1003 and data == b"lo world"
    assert unpack_frame(pack_frame(7, b"x")) == (7, b"x")


def test_reset_and_release_keep_offsets() -> None:
    ring = OutputRing(64)
    ring.append(b"x" * 30)
    ring.reset(500)
    assert (ring.start, ring.end, len(ring)) == (500, 500, 0)
    ring.append(b"abc")
    assert ring.read(500, 3) == b"abc"
    ring.release()
    assert ring.start == ring.end == 503


@settings(max_examples=200)
@given(
    capacity=st.integers(min_value=1, max_value=300),
    chunks=st.lists(st.binary(min_size=0, max_size=200), max_size=40),
)
def test_server_ring_matches_a_reference(capacity: int, chunks: list[bytes]) -> None:
    ring = OutputRing(capacity)
    stream = b"".join(chunks)
    for chunk in chunks:
        ring.append(chunk)
    assert ring.end == len(stream)
    assert ring.start == max(0, len(stream) - capacity)
    assert ring.read(ring.start, capacity) == stream[ring.start :]
    if len(stream) > 1:
        mid = (ring.start + ring.end) // 2
        assert ring.read(mid, 7) == stream[mid : mid + 7]


@settings(max_examples=200)
@given(
    capacity=st.integers(min_value=4096, max_value=20000),
    sizes=st.lists(st.integers(min_value=0, max_value=4096), max_size=40),
)
def test_agent_ring_matches_a_reference(capacity: int, sizes: list[int]) -> None:
    ring = Ring(capacity)
    stream = bytearray()
    for i, size in enumerate(sizes):
        chunk = bytes([i % 251]) * size
        ring.append(chunk)
        stream += chunk
    assert ring.end == len(stream)
    assert ring.start == max(0, len(stream) - capacity)
    assert ring.read(ring.start, capacity) == bytes(stream[ring.start :])


def test_agent_ring_rejects_oversized_appends() -> None:
    with pytest.raises(ValueError):
        Ring(4096).append(b"x" * 5000)


@settings(max_examples=50)
@given(
    capacity=st.integers(min_value=4096, max_value=20000),
    sizes=st.lists(st.integers(min_value=1, max_value=4096), max_size=30),
)
def test_a_shared_ring_reads_a_pipe_straight_in_and_another_process_takes_it_on(
    capacity: int, sizes: list[int]
) -> None:
    """What the keeper hands a new worker: the same bytes and offsets, by descriptor."""
    ring = Ring.shared(capacity, "test")
    stream = bytearray()
    r, w = os.pipe()
    try:
        for i, size in enumerate(sizes):
            chunk = bytes([i % 251]) * size
            os.write(w, chunk)
            assert ring.read_from(r, size) == size
            stream += chunk
        assert ring.end == len(stream) and ring.start == max(0, len(stream) - capacity)
        assert ring.read(ring.start, capacity) == bytes(stream[ring.start :])
        assert ring.fd is not None
        again = Ring.attach(os.dup(ring.fd))
        assert (again.start, again.end, again.capacity) == (ring.start, ring.end, capacity)
        assert again.read(again.start, capacity) == bytes(stream[ring.start :])
        again.append(b"more")  # the new owner goes on where the old one stopped
        assert again.read(again.end - 4, 4) == b"more"
        ring.close()
        again.close()
    finally:
        os.close(r)
        os.close(w)


def test_attach_refuses_what_is_not_a_ring() -> None:
    fd = os.memfd_create("not-a-ring")
    try:
        with pytest.raises(ValueError, match="not a ring"):
            Ring.attach(fd)
        os.ftruncate(fd, 4096 + 8192)
        os.pwrite(fd, (10**6).to_bytes(8, "little") + (0).to_bytes(8, "little"), 0)
        with pytest.raises(ValueError, match="out of bounds"):
            Ring.attach(fd)
    finally:
        os.close(fd)
