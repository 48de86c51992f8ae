"""Event cursor semantics, filters, SSE resume with Last-Event-ID, slow-client gaps."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from agentic_sandbox.broker.observability.events import EventFilter
from tests.support.inproc_server import Running


def publish_many(running: Running, n: int, **kw: Any) -> None:
    for i in range(n):
        kind = ("instance.created", "session.opened", "host.added")[i % 3]
        running.svc.events.publish(
            kind, actor="test", instance_id=f"vm-{i % 4}", data={"i": i}, **kw
        )


async def all_pages(running: Running, query: str = "", limit: int = 7) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = 0
    for _ in range(1000):
        status, page, _ = await running.call(
            "GET", f"/api/v1/events?after={after}&limit={limit}{query}"
        )
        assert status == 200, page
        out.extend(page["items"])
        if not page["items"]:
            break
        assert page["next"] >= page["items"][-1]["seq"]
        after = page["next"]
    return out


async def test_pagination_returns_every_event_once_in_order(running: Running) -> None:
    publish_many(running, 50)
    events = await all_pages(running)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs))
    mine = [e for e in events if e["actor"] == "test"]
    assert [e["data"]["i"] for e in mine] == list(range(50))


async def test_pagination_beyond_the_ring_reads_the_database(tmp_path: object) -> None:
    from pathlib import Path

    from tests.support.inproc_server import make_settings, start_server

    async with start_server(make_settings(Path(str(tmp_path)), events_ring_size=100)) as r:
        publish_many(r, 450)
        events = await all_pages(r, limit=200)
        mine = [e["data"]["i"] for e in events if e["actor"] == "test"]
        assert mine == list(range(450))


async def test_type_and_subject_filters(running: Running) -> None:
    publish_many(running, 30)
    only = await all_pages(running, "&type=session.opened")
    assert only and {e["type"] for e in only} == {"session.opened"}
    fam = await all_pages(running, "&type=instance.*,host.*")
    assert {e["type"] for e in fam} == {"instance.created", "host.added"}
    vm1 = await all_pages(running, "&instance_id=vm-1")
    assert vm1 and {e["instance_id"] for e in vm1} == {"vm-1"}


async def test_invalid_cursor_is_400_problem(running: Running) -> None:
    for bad in ("abc", "-1", "99999999"):
        status, body, resp = await running.call("GET", f"/api/v1/events?after={bad}")
        assert status in (400, 422), (bad, body)
        assert resp.content_type == "application/problem+json"
        assert "after" in body["detail"]
    status, body, _ = await running.call("GET", "/api/v1/events?after=99999999")
    assert status == 400 and body["code"] == "invalid-cursor"


async def read_sse(resp: aiohttp.ClientResponse, count: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    block: dict[str, str] = {}
    while len(events) < count:
        line = (await asyncio.wait_for(resp.content.readline(), 10)).decode().rstrip("\n")
        if not line:
            if "data" in block:
                events.append(
                    {
                        "id": block.get("id"),
                        "event": block.get("event"),
                        **json.loads(block["data"]),
                    }
                )
            block = {}
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(": ")
        block[key] = value
    return events


async def test_sse_resumes_from_last_event_id_without_gap_or_duplicate(running: Running) -> None:
    publish_many(running, 10)
    url = running.url + "/api/v1/events/stream?type=instance.*,session.*,host.*"
    async with running.http.get(url, headers=running.auth()) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        first = await read_sse(resp, 5)
    last_id = first[-1]["id"]
    publish_many(running, 10)  # published while disconnected
    async with running.http.get(url, headers={**running.auth(), "Last-Event-ID": last_id}) as resp:
        rest = await read_sse(resp, 15)
        publish_many(running, 3)  # live after the replay
        live = await read_sse(resp, 3)
    seqs = [e["seq"] for e in first + rest + live]
    assert seqs == list(range(seqs[0], seqs[0] + 23)), seqs
    assert [int(e["id"]) for e in first + rest + live] == seqs


async def test_slow_sse_client_is_told_it_missed_events(tmp_path: object) -> None:
    from pathlib import Path

    from tests.support.inproc_server import make_settings, start_server

    settings = make_settings(Path(str(tmp_path)), sse_client_queue=10)
    async with start_server(settings) as r:
        sub = r.svc.events.subscribe(EventFilter(), 10)
        publish_many(r, 30)
        got = [await sub.get() for _ in range(11)]
        sub.close()
        assert [e.seq for e in got[:10]] == list(range(got[0].seq, got[0].seq + 10))
        assert got[10].type == "stream.gap"
        assert got[10].data["first_missed_seq"] == got[9].seq + 1


async def test_non_admin_sees_only_own_events(running: Running) -> None:
    viewer = await running.make_token("vera", "viewer")
    running.svc.events.publish("instance.created", instance_id="a-1", owner="vera")
    running.svc.events.publish("instance.created", instance_id="b-1", owner="bob")
    status, page, _ = await running.call("GET", "/api/v1/events?type=instance.*", token=viewer)
    assert status == 200
    assert [e["instance_id"] for e in page["items"]] == ["a-1"]
