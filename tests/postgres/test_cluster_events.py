"""Events across two real servers on one PostgreSQL: an SSE client on the follower sees what
the leader publishes (the follower's tail: LISTEN + poll), and after `kill -9` of the leader a
client that resumes with its cursor on the new leader gets every stored event once — no gap,
no duplicate — while the follower's own stream carries on through the promotion. A token
revoked on the leader ends its stream on the follower."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests.postgres.test_cluster_servers import TIMEOUT, node, request, roles
from tests.support.server import ServerProcess
from tests.support.sse import Frame, SseReader


def make_instances(srv: ServerProcess, names: list[str]) -> None:
    for name in names:  # each publishes `instance.created` on the leader
        status, _, body = request(
            srv, "POST", "/api/v2/admin/agents/host-instances", {"instance_id": name}
        )
        assert status == 201, (status, body)


def created(name: str) -> object:
    def pred(f: Frame) -> bool:
        return f.event == "instance.created" and json.loads(f.data)["instance_id"] == name

    return pred


def seqs(sse: SseReader) -> list[int]:
    return [int(f.id) for f in sse.frames if f.id is not None]


async def stored_seqs(pg_url: str) -> list[int]:
    engine = create_async_engine(pg_url)
    try:
        async with engine.connect() as conn:
            return list((await conn.execute(text("SELECT seq FROM events ORDER BY seq"))).scalars())
    finally:
        await engine.dispose()


async def test_follower_streams_live_and_a_cursor_survives_kill9(
    pg_url: str, tmp_path: Path
) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    streams: list[SseReader] = []
    try:
        n1.start(TIMEOUT)
        roles(n1)  # n1 leads
        n2.start(TIMEOUT)
        leader, _ = roles(n1, n2)
        assert leader is n1
        auth = {"Authorization": f"Bearer {n1.admin_token}"}

        on_follower = await SseReader.open(n2.url + "/api/v1/events/stream?after=0", auth)
        streams.append(on_follower)
        on_leader = await SseReader.open(n1.url + "/api/v1/events/stream?after=0", auth)
        streams.append(on_leader)

        make_instances(n1, [f"ev-{i}" for i in range(5)])
        await on_follower.wait(created("ev-4"), TIMEOUT)  # live on the follower
        await on_leader.wait(created("ev-4"), TIMEOUT)
        assert seqs(on_follower) == list(range(1, len(seqs(on_follower)) + 1))

        # a token revoked on the leader ends its stream on the follower too
        _, _, made = request(n1, "POST", "/api/v2/admin/tokens", {"subject": "v", "role": "viewer"})
        viewer = await SseReader.open(
            n2.url + "/api/v1/events/stream", {"Authorization": f"Bearer {made['token']}"}
        )
        streams.append(viewer)
        status, _, _ = request(n1, "DELETE", f"/api/v2/admin/tokens/{made['id']}")
        assert status == 204
        await viewer.wait(lambda f: f.event == "revoked", TIMEOUT)

        # More events, then kill -9 of the leader at once: what it had not stored is gone
        # for everyone; what anyone saw is stored.
        make_instances(n1, [f"ev-{i}" for i in range(5, 15)])
        n1.kill9()
        await on_leader.wait_ended(TIMEOUT)
        seen_before = seqs(on_leader)
        cursor = seen_before[-1]

        new_leader, _ = roles(n2)
        assert new_leader is n2
        resumed = await SseReader.open(
            n2.url + "/api/v1/events/stream", {**auth, "Last-Event-ID": str(cursor)}
        )
        streams.append(resumed)
        make_instances(n2, ["ev-after"])
        await resumed.wait(created("ev-after"), TIMEOUT)
        await on_follower.wait(created("ev-after"), TIMEOUT)  # it carried on through promotion

        stored = await stored_seqs(pg_url)
        assert stored == list(range(1, len(stored) + 1))  # the log itself has no hole
        joined = seen_before + seqs(resumed)
        last = joined[-1]
        assert joined == list(range(1, last + 1))  # no gap, no duplicate
        follower_seen = seqs(on_follower)
        assert follower_seen == list(range(1, follower_seen[-1] + 1))
        assert set(follower_seen) <= set(stored) and set(joined) <= set(stored)
        assert not any(f.event == "gap" for f in resumed.frames + on_follower.frames)
    finally:
        for sse in streams:
            await sse.close()
        n1.stop()
        n2.stop()
