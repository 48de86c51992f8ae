"""Where the control plane is: every control host's address, and which one to dial next.

Several control hosts share one PostgreSQL and one of them leads (the server's
`broker/cluster/`); only the leader holds agent links. An agent is given every control host
(`server = "a:8120,b:8120"`, `enroll_server` in the same order, or each server's host with
port 8121). It dials the one that last worked; when that fails it tries the next at once, and
backs off only after every address failed in a row. A follower refuses with `UNAVAILABLE` and
names the leader (`proto.LEADER_METADATA`): when that address is one of the agent's own, it is
dialled next, without a pause. An address the agent was not given is never dialled — a
follower's word moves the agent among its configured control hosts, nowhere else.

A guest's agent dials the guest link gateway instead (`gateway`), which leads to whichever
node leads on its host; the list is then not used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from agentic_sandbox.proto import LEADER_METADATA

log = logging.getLogger("agent")


@dataclass(frozen=True)
class ControlAddress:
    link: str  # HOST:PORT of the mutual-TLS agent link (Connect, Renew)
    enroll: str  # HOST:PORT of the server-auth TLS enrollment listener


def leader_hint(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str, str] | None:
    """`(node, address)` from a follower's trailing metadata, else None."""
    for key, value in metadata or ():
        if key == LEADER_METADATA:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            node, _, address = text.strip().partition(" ")
            if node and address:
                return node, address
    return None


class Controls:
    """The agent's control addresses and the one it dials now."""

    def __init__(self, addresses: list[ControlAddress]) -> None:
        if not addresses:
            raise ValueError("at least one control address")
        self.addresses = list(addresses)
        self._index = 0
        self._failed_in_a_row = 0

    def __len__(self) -> int:
        return len(self.addresses)

    @property
    def current(self) -> ControlAddress:
        return self.addresses[self._index]

    def succeeded(self) -> None:
        """The current address holds the link: stay on it."""
        self._failed_in_a_row = 0

    def failed(self, hint: tuple[str, str] | None = None) -> bool:
        """The current address failed (`hint`: the leader it named). Moves to the address to
        dial next; True when that should be dialled at once, False when every address failed
        in a row (back off first)."""
        following = self._index_of(hint) if hint is not None else None
        # a redirect counts as a try too: two nodes naming each other back off, not spin
        self._failed_in_a_row += 1
        self._index = following if following is not None else (self._index + 1) % len(self)
        if self._failed_in_a_row >= len(self.addresses):
            self._failed_in_a_row = 0
            return False
        return True

    def _index_of(self, hint: tuple[str, str]) -> int | None:
        node, address = hint
        for i, a in enumerate(self.addresses):
            if a.link == address:
                log.info("control host %s leads: dialling %s", node, address)
                return i
        log.warning(
            "%s says control host %s leads at %s, which is not one of this agent's control "
            "addresses (%s); trying the next",
            self.current.link,
            node,
            address,
            ", ".join(a.link for a in self.addresses),
        )
        return None
