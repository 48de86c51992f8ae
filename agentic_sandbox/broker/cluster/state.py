"""What a node knows about leadership: its role, its term and who leads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Role(StrEnum):
    leader = "leader"
    follower = "follower"
    single = "single-node"  # SQLite: one server owns the data dir, always leads


@dataclass(frozen=True)
class LeaderInfo:
    node: str
    url: str  # its public HTTP URL
    grpc: str  # its agent-link address


@dataclass(frozen=True)
class NodeInfo:
    """This node, as it advertises itself to the others."""

    node: str
    url: str
    grpc: str
    version: str


class Leadership(Protocol):
    """The server's view of leadership (`SingleNode` on SQLite, `Elector` on PostgreSQL)."""

    me: NodeInfo

    @property
    def role(self) -> Role: ...

    @property
    def term(self) -> int | None: ...

    @property
    def leader(self) -> LeaderInfo | None: ...

    @property
    def previous_leader(self) -> str | None:
        """The node that led the term before this node's (None: none did, or no terms)."""

    def on_lost(self, fn: Callable[[str], None]) -> None:
        """`fn(reason)` runs once when this node stops being the leader without asking to."""

    async def start(self) -> None: ...

    async def elected(self) -> None:
        """Return once this node leads."""

    async def stop(self) -> None:
        """Give up leadership (after the last write) and close."""


def interruption(cluster: Leadership | None) -> str:
    """Why work that was running when this node began to lead cannot go on: the server
    restarted, or (a failover) the node that led before stopped."""
    if cluster is None or cluster.role is not Role.leader:
        return "the server restarted"
    prev = cluster.previous_leader
    if prev and prev != cluster.me.node:
        return f"the leader {prev} stopped; {cluster.me.node} leads now (term {cluster.term})"
    return f"the server restarted ({cluster.me.node} leads term {cluster.term})"
