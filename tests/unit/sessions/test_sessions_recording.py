"""asciicast v2 recordings: format, UTF-8 across chunks, resend dedupe, crash checkpoints."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agentic_sandbox.broker.sessions.recording import Recording, encode_string


def _events(path: Path) -> tuple[dict[str, object], list[list[object]]]:
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def _make(path: Path, **kw: object) -> Recording:
    return Recording.create(
        path,
        cols=100,
        rows=30,
        title="demo",
        command=["/bin/bash"],
        started_wall=time.time(),
        max_bytes=int(kw.get("max_bytes", 1 << 20)),  # type: ignore[call-overload]
        record_input=bool(kw.get("record_input", False)),
    )


def test_header_events_and_utf8_split_across_chunks(tmp_path: Path) -> None:
    path = tmp_path / "s.cast"
    rec = _make(path, record_input=True)
    snow = "☃".encode()
    rec.output(0, b"hello " + snow[:1])
    rec.output(7, snow[1:] + b"!\r\n")
    rec.resize(120, 40)
    rec.input(b"ls\r")
    rec.output(5, b" \xe2\x98\x83!\r\nnew")  # partly a resend after a reconnect
    rec.close()
    header, events = _events(path)
    assert header["version"] == 2 and header["width"] == 100 and header["height"] == 30
    assert header["title"] == "demo"
    out = "".join(str(e[2]) for e in events if e[1] == "o")
    assert out == "hello ☃!\r\nnew"
    assert ["r", "120x40"] in [e[1:] for e in events]
    assert ["i", "ls\r"] in [e[1:] for e in events]
    assert all(isinstance(e[0], float | int) for e in events)


def test_a_gap_is_marked(tmp_path: Path) -> None:
    path = tmp_path / "g.cast"
    rec = _make(path)
    rec.output(0, b"abc")
    rec.output(10, b"xyz")
    rec.close()
    _, events = _events(path)
    assert any(e[1] == "m" and "gap" in str(e[2]) for e in events)


def test_resume_cuts_back_to_the_last_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "c.cast"
    rec = _make(path)
    rec.output(0, b"first part|")
    rec.flush()  # checkpoint: 11 bytes recorded
    rec.output(11, b"second part, never flushed before the crash")
    rec._file.flush()  # the OS has it, the checkpoint does not (a crash right here)
    resumed = Recording.resume(
        path, started_wall=time.time(), max_bytes=1 << 20, record_input=False
    )
    assert resumed is not None and resumed.offset == 11
    resumed.output(0, b"first part|second part, resent")
    resumed.close()
    _, events = _events(path)
    out = "".join(str(e[2]) for e in events if e[1] == "o")
    assert out == "first part|second part, resent"


def test_size_limit_truncates_with_a_marker(tmp_path: Path) -> None:
    path = tmp_path / "t.cast"
    rec = _make(path, max_bytes=600)
    for i in range(50):
        rec.output(i * 20, b"0123456789abcdefghij")
    rec.close()
    _, events = _events(path)
    assert events[-1][1] == "m" and "truncated" in str(events[-1][2])
    assert path.stat().st_size < 800


def test_output_close_together_is_one_event_in_order_with_the_others(
    tmp_path: Path, monkeypatch: object
) -> None:
    import agentic_sandbox.broker.sessions.recording as recording

    clock = [1000.0]
    monkeypatch.setattr(recording.time, "time", lambda: clock[0])  # type: ignore[attr-defined]
    path = tmp_path / "b.cast"
    rec = Recording.create(
        path,
        cols=80,
        rows=24,
        title="",
        command=None,
        started_wall=1000.0,
        max_bytes=0,
        record_input=False,
    )
    for i, chunk in enumerate((b'a"b', b"\\c\x1b[1m", "☃\n".encode())):  # within the window
        clock[0] = 1000.5 + i * recording.BATCH_SECONDS / 10
        rec.output(rec.offset, chunk)
    clock[0] = 1001.0
    rec.resize(100, 30)  # the batch is written before it
    clock[0] = 1002.0
    rec.output(rec.offset, b"x")
    clock[0] = 1003.0
    rec.output(rec.offset, b"y")  # past the window: an event of its own
    rec.close()
    lines = path.read_text().splitlines()[1:]
    events = [json.loads(line) for line in lines]
    assert events == [
        [0.5, "o", 'a"b\\c\x1b[1m☃\n'],
        [1.0, "r", "100x30"],
        [2.0, "o", "x"],
        [3.0, "o", "y"],
    ]
    # the same bytes json.dumps writes
    assert lines == [json.dumps(e, ensure_ascii=False) for e in events]


def test_a_checkpoint_never_claims_output_still_in_a_batch(tmp_path: Path) -> None:
    path = tmp_path / "c.cast"
    rec = _make(path)
    rec.output(0, b"0123456789")
    rec.checkpoint()  # the batch is not written yet
    size, offset = struct.unpack(">QQ", (tmp_path / "c.cast.ckpt").read_bytes()[:16])
    assert offset == 0 and size == path.stat().st_size
    rec.flush()  # writes the batch, then checkpoints it
    size, offset = struct.unpack(">QQ", (tmp_path / "c.cast.ckpt").read_bytes()[:16])
    assert offset == 10 and size == path.stat().st_size
    rec.close()


@given(
    st.text(
        alphabet=st.sampled_from(["a", "b", " ", '"', "\\", "\n", "\r", "\x1b", "\x00", "\t", "é"])
        | st.characters(blacklist_categories=("Cs",)),  # text decoded from UTF-8 has none
        max_size=300,
    )
)
def test_encode_string_makes_the_bytes_json_dumps_makes(text: str) -> None:
    assert encode_string(text) == json.dumps(text, ensure_ascii=False).encode()


def test_encode_string_on_long_plain_and_sparse_output() -> None:
    for text in ("x" * 70000, ('log line "q" \\ path\t\x1b[1m\r\n' * 3000), "y\n" * 5000):
        assert encode_string(text) == json.dumps(text, ensure_ascii=False).encode()
