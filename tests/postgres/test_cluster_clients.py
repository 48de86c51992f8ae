"""Clients follow the leader across two real servers on one PostgreSQL: the SDK and
`sandboxctl` given the follower's URL (or both) complete writes on the leader, and the SDK's
event follow given both URLs goes on after `kill -9` of the leader with no gap and no
duplicate."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from agentic_sandbox.sdk import AsyncClient, Event
from tests.postgres.test_cluster_servers import TIMEOUT, node, roles
from tests.support.cli import Sandboxctl


async def test_sdk_and_sandboxctl_write_through_the_follower_and_follow_a_failover(
    pg_url: str, tmp_path: Path
) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    follow: asyncio.Task[None] | None = None
    client: AsyncClient | None = None
    try:
        n1.start(TIMEOUT)
        roles(n1)  # n1 leads
        n2.start(TIMEOUT)
        leader, _ = roles(n1, n2)
        assert leader is n1
        token = n1.admin_token

        # the SDK given only the follower: its 307 is followed with the token
        async with AsyncClient(n2.url, token) as sdk:
            made = await sdk.tokens.create("via-follower", role="viewer")
            assert made.token
            assert sdk._transport.url == n1.url  # the leader is remembered
        # sandboxctl given the follower first
        ctl = Sandboxctl(f"{n2.url},{n1.url}", token, tmp_path / "ctl")
        res = ctl("token", "create", "--subject", "via-ctl", "--role", "viewer", "-o", "json")
        assert res.returncode == 0, res.stderr
        # a read: the follower serves it itself
        res = ctl("token", "list", "-o", "json")
        assert res.returncode == 0 and "via-ctl" in res.stdout and "via-follower" in res.stdout

        # the SDK's follow given both URLs, across kill -9 of the leader
        seen: list[Event] = []
        changed = asyncio.Event()
        client = AsyncClient(f"{n1.url},{n2.url}", token)

        async def follower_loop() -> None:
            assert client is not None
            async for ev in client.events.follow(after=0, reconnect_within=TIMEOUT):
                seen.append(ev)
                changed.set()

        async def wait_for(name: str) -> None:
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while not any(e.instance_id == name and e.type == "instance.created" for e in seen):
                left = deadline - asyncio.get_running_loop().time()
                assert left > 0, f"no instance.created for {name}; seen {[e.seq for e in seen]}"
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)

        follow = asyncio.create_task(follower_loop())
        for i in range(5):
            await client.instances.register_host(f"pre-{i}")
        await wait_for("pre-4")
        n1.kill9()
        # waited for in a thread: the client's loop meanwhile sees its connections to n1 end
        new, _ = await asyncio.to_thread(roles, n2)
        assert new is n2
        await client.instances.register_host("post")  # n1 is unreachable: n2 serves it
        await wait_for("post")
        got = [e.seq for e in seen]
        assert got == list(range(1, got[-1] + 1))  # no gap, no duplicate
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        follow = None
    finally:
        if follow is not None:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
        if client is not None:
            await client.close()
        n1.stop()
        n2.stop()
