"""A provision is ready only when the agent of *its* incarnation connects: a live link of an
earlier instance with the same id (a process that kept the old certificate) never counts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentic_sandbox.broker.instances.enroller import LinkEnroller


@dataclass
class FakeConn:
    instance_id: str
    incarnation: str
    ready: bool = True


@dataclass
class FakeRegistry:
    links: dict[str, FakeConn] = field(default_factory=dict)
    listeners: list[Any] = field(default_factory=list)

    def ready(self, instance_id: str, incarnation: str | None = None) -> bool:
        conn = self.links.get(instance_id)
        return (
            conn is not None
            and conn.ready
            and (incarnation is None or conn.incarnation == incarnation)
        )

    def connect(self, conn: FakeConn) -> None:
        self.links[conn.instance_id] = conn
        for fn in self.listeners:
            fn(conn, "connected")


async def _settle() -> None:
    """Let every ready task run until it waits (no timing involved)."""
    for _ in range(5):
        await asyncio.sleep(0)


class FakeLink:
    def __init__(self) -> None:
        self.registry = FakeRegistry()


async def test_an_old_incarnations_link_does_not_make_a_new_provision_ready() -> None:
    link = FakeLink()
    enroller = LinkEnroller(link, settings=None)  # type: ignore[arg-type]
    link.registry.connect(FakeConn("vm-3", "old-incarnation"))  # alice's agent, still connected

    waiting = asyncio.create_task(enroller.wait_ready("vm-3", "new-incarnation"))
    await _settle()
    assert not waiting.done(), "the old link must not count"
    link.registry.connect(FakeConn("vm-3", "old-incarnation"))  # it reconnects: still not
    await _settle()
    assert not waiting.done()

    link.registry.connect(FakeConn("vm-3", "new-incarnation"))  # the new guest's agent
    await asyncio.wait_for(waiting, 1)


async def test_a_ready_link_of_the_same_incarnation_returns_at_once() -> None:
    link = FakeLink()
    enroller = LinkEnroller(link, settings=None)  # type: ignore[arg-type]
    link.registry.connect(FakeConn("vm-4", "inc-a"))
    await asyncio.wait_for(enroller.wait_ready("vm-4", "inc-a"), 1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(enroller.wait_ready("vm-4", "inc-b"), 0.1)
