"""Secret redaction on a byte stream: same length, whatever the writes' sizes and timing.

The reference below is the definition, one byte at a time: at each position, a secret that
could still start there (the rest of the stream is a proper prefix of one) masks the rest of a
stream that ends there; else the longest secret that starts there is masked; else the byte is
shown. The redactor must give exactly that for every way of cutting the stream into writes.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_sandbox.broker.sessions.redaction import MIN_SECRET_BYTES, StreamRedactor

SECRET = "hunter2-correct-horse"
# Repeated characters, secrets that are prefixes of others, secrets that overlap each other.
SHARED = ["aaab", "abab", "abcd", "abcdefgh", "bcdx", "xxxxxxxxxxxy"]


def reference(stream: bytes, secrets: list[str]) -> bytes:
    values = sorted(
        {s.encode() for s in secrets if len(s.encode()) >= MIN_SECRET_BYTES}, key=len, reverse=True
    )
    out = bytearray()
    p = 0
    while p < len(stream):
        rest = stream[p:]
        if any(len(rest) < len(v) and v.startswith(rest) for v in values):
            out += b"*" * len(rest)  # the stream ended inside what may be a secret
            break
        hit = next((v for v in values if rest.startswith(v)), None)
        if hit is not None:
            out += b"*" * len(hit)
            p += len(hit)
        else:
            out.append(stream[p])
            p += 1
    return bytes(out)


def redact(secrets: list[str], writes: list[bytes]) -> tuple[bytes, int]:
    """The whole output for these writes, then the end of the stream; and the most held."""
    r = StreamRedactor(secrets)
    out = bytearray()
    most = 0
    for w in writes:
        out += r.feed(w)
        most = max(most, r.held)
    out += r.mask_held()
    return bytes(out), most


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


def test_a_held_start_is_released_only_when_the_match_fails() -> None:
    r = StreamRedactor([SECRET])
    assert r.feed(b"hunter") == b""
    assert r.feed(b"") == b""  # nothing new decides nothing: still held, however long
    assert r.held == 6
    assert r.feed(b"s") == b"hunters"  # not the secret after all
    assert r.feed(b"hunter") == b""
    assert r.drop_held() == 6 and r.held == 0


def test_a_secret_printed_one_byte_at_a_time_is_masked() -> None:
    stream = f"key={SECRET}\r\n".encode()
    out, most = redact([SECRET], [bytes([b]) for b in stream])
    assert out == b"key=" + b"*" * len(SECRET) + b"\r\n"
    assert most == len(SECRET) - 1  # never more than a secret's length, less one byte


def test_the_stream_ending_inside_a_secret_masks_what_was_held() -> None:
    r = StreamRedactor([SECRET])
    shown = r.feed(b"$ " + SECRET[:-1].encode())  # all but its last character, then the end
    assert shown == b"$ "
    assert r.mask_held() == b"*" * (len(SECRET) - 1)
    assert r.held == 0


def test_a_longer_secret_sharing_a_prefix_is_masked_whole() -> None:
    # "abcd" is complete after the first write, but "abcdefgh" may follow: held, not decided.
    r = StreamRedactor(["abcd", "abcdefgh"])
    assert r.feed(b"-abcd") == b"-"
    assert r.feed(b"efgh-") == b"********-"
    assert r.feed(b"abcd") == b""
    assert r.feed(b"x") == b"****x"


def test_secrets_removed_later_release_what_they_held() -> None:
    r = StreamRedactor([SECRET])
    assert r.feed(b"hunt") == b""
    r.set([])
    assert r.feed(b"") == b"hunt"
    assert not r.active


def test_no_secrets_means_no_work() -> None:
    r = StreamRedactor()
    data = b"anything at all"
    assert r.feed(data) is data and not r.active


def _writes(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(stream)})
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]


@settings(max_examples=300)
@given(
    parts=st.lists(st.sampled_from(["a", "hunter", SECRET, "x\r\n", "hunter2", "-"]), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_any_chunking_gives_the_same_redacted_stream(parts: list[str], cuts: list[int]) -> None:
    stream = "".join(parts).encode()
    out, most = redact([SECRET], _writes(stream, cuts))
    assert out == reference(stream, [SECRET])
    assert len(out) == len(stream)
    assert most < len(SECRET)


@settings(max_examples=500)
@given(
    stream=st.binary(max_size=200).map(lambda b: bytes(b"abcdxy\n"[c % 7] for c in b)),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=30),
    secrets=st.lists(st.sampled_from(SHARED), min_size=1, max_size=6),
)
def test_shared_prefixes_and_repeated_characters_under_any_chunking(
    stream: bytes, cuts: list[int], secrets: list[str]
) -> None:
    out, most = redact(secrets, _writes(stream, cuts))
    assert out == reference(stream, secrets)
    assert len(out) == len(stream)
    assert most < max(len(s) for s in secrets)
    # One byte at a time gives the same.
    assert redact(secrets, [bytes([b]) for b in stream])[0] == out
    # A stream that does not end inside a secret is exactly `re.sub` over all of it.
    values = sorted({s.encode() for s in secrets}, key=len, reverse=True)
    whole = stream + b"\n"
    expected = re.sub(b"|".join(re.escape(v) for v in values), lambda m: b"*" * len(m[0]), whole)
    assert redact(secrets, _writes(whole, cuts))[0] == expected


@settings(max_examples=200)
@given(
    secret=st.text(alphabet="ab", min_size=4, max_size=12),
    noise=st.lists(st.text(alphabet="ab", max_size=6), min_size=2, max_size=2),
)
def test_no_chunking_lets_a_secret_through(secret: str, noise: list[str]) -> None:
    stream = (noise[0] + secret + noise[1]).encode()
    for size in (1, 2, 3, 5):
        writes = [stream[i : i + size] for i in range(0, len(stream), size)]
        out, _ = redact([secret], writes)
        assert secret.encode() not in out
