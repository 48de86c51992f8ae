"""An image upload tells its bytes a few dozen times, whatever the chunking; the provision
pipeline keeps them on its `uploading` stage."""

from __future__ import annotations

import io

from agentic_sandbox.fleet.libvirt.storage import PROGRESS_STEPS, counting_reader
from agentic_sandbox.provision.pipeline import StageClock, StageRecord


def drain(read: object, chunk: int) -> bytes:
    out = bytearray()
    while True:
        data = read(chunk)  # type: ignore[operator]
        if not data:
            return bytes(out)
        out += data


def test_an_upload_reports_its_bytes_in_bounded_steps_up_to_the_total() -> None:
    total = 10 * 1024 * 1024 + 7
    heard: list[tuple[int, int]] = []
    src = io.BytesIO(b"x" * total)
    got = drain(counting_reader(src.read, total, lambda d, t: heard.append((d, t))), 4096)
    assert len(got) == total
    assert heard[-1] == (total, total)
    assert all(t == total for _, t in heard)
    assert [d for d, _ in heard] == sorted({d for d, _ in heard})  # growing, never repeated
    assert len(heard) <= PROGRESS_STEPS + 1, len(heard)  # not one call per 4 KiB chunk


def test_a_small_upload_still_reports_its_end() -> None:
    heard: list[tuple[int, int]] = []
    src = io.BytesIO(b"abc")
    drain(counting_reader(src.read, 3, lambda d, t: heard.append((d, t))), 1 << 20)
    assert heard == [(3, 3)]


def test_no_listener_means_the_plain_reader() -> None:
    src = io.BytesIO(b"abc")
    assert counting_reader(src.read, 3, None) == src.read


def test_stage_details_ride_on_the_stage_record_and_reach_the_listener() -> None:
    told: list[tuple[str, list[dict[str, object]]]] = []

    def listener(name: str, records: list[StageRecord]) -> None:
        told.append((name, [r.as_dict(records[0].started) for r in records]))

    clock = StageClock(listener)
    clock.begin("placing")
    clock.detail("uploading", {"bytes_done": 0, "bytes_total": 100})
    clock.detail("uploading", {"bytes_done": 100, "bytes_total": 100})
    clock.begin("disk")
    names = [r["name"] for r in clock.timings()]
    assert names == ["placing", "uploading", "disk"]
    upload = clock.timings()[1]
    assert upload["bytes_done"] == 100 and upload["bytes_total"] == 100
    assert upload["seconds"] is not None
    assert [n for n, _ in told] == ["placing", "uploading", "uploading", "uploading", "disk"]
    assert told[2][1][1]["bytes_done"] == 0 and told[3][1][1]["bytes_done"] == 100
