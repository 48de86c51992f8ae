"""Secret redaction on a byte stream: same length, across chunk boundaries, flushable."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_sandbox.broker.sessions.redaction import StreamRedactor

SECRET = "hunter2-correct-horse"


def test_whole_and_split_secrets_are_masked_with_the_same_length() -> None:
    r = StreamRedactor([SECRET, "abc"])  # values under 4 bytes are ignored
    out = r.feed(f"token={SECRET}!".encode())
    assert out == b"token=" + b"*" * len(SECRET) + b"!"
    first = r.feed(b"x " + SECRET[:7].encode())
    assert first == b"x "  # the tail could be the start of a secret: held back
    assert r.held == 7
    rest = r.feed(SECRET[7:].encode() + b" y")
    assert rest == b"*" * len(SECRET) + b" y"
    assert r.feed(b"abc") == b"abc"


def test_a_held_tail_that_was_not_a_secret_is_flushed() -> None:
    r = StreamRedactor([SECRET])
    assert r.feed(b"hunter") == b""
    assert r.flush() == b"hunter"
    assert r.feed(b"hunter") == b""
    assert r.drop_held() == 6 and r.held == 0


def test_no_secrets_means_no_work() -> None:
    r = StreamRedactor()
    data = b"anything at all"
    assert r.feed(data) is data and not r.active


@settings(max_examples=300)
@given(
    parts=st.lists(st.sampled_from(["a", "hunter", SECRET, "x\r\n", "hunter2", "-"]), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_any_chunking_gives_the_same_redacted_stream(parts: list[str], cuts: list[int]) -> None:
    stream = "".join(parts).encode()
    expected = stream.replace(SECRET.encode(), b"*" * len(SECRET))
    r = StreamRedactor([SECRET])
    out = bytearray()
    last = 0
    for cut in sorted(c for c in cuts if c <= len(stream)):
        out += r.feed(stream[last:cut])
        last = cut
    out += r.feed(stream[last:])
    out += r.flush()
    assert bytes(out) == expected
    assert len(out) == len(stream)
