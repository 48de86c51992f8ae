"""Instance incarnations: what is bound to one create of an instance id ends with it.

An instance id is a name people choose and may reuse; each create makes a new incarnation, an
immutable UUID in `instances.incarnation`. Everything bound to an instance records the
incarnation it belongs to (enrollment tokens, agent certificates, the live agent link, A2A keys,
secret bindings, shares, sessions, tasks, AgentCard keys), and every lookup of such a thing
compares it with the instance's current incarnation — so a new instance with an old id starts
from nothing, whoever creates it.

Ending an incarnation (a delete, a failed provision) is this module's `end`: the components that
hold bound state register a hook with `on_end` (the agent link closes the live link and revokes
certificates and tokens; the session hub ends the instance's sessions; the task layer fails its
unfinished tasks; auth revokes its A2A keys; the vault drops its bindings; …). Every hook runs even
when an earlier one fails; failures are logged and returned, never silently dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy import select

from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndedIncarnation:
    instance_id: str
    incarnation: str
    actor: str
    reason: str


Hook = Callable[[EndedIncarnation], Awaitable[None]]


class Incarnations:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._hooks: list[tuple[str, Hook]] = []

    def on_end(self, name: str, hook: Hook) -> None:
        """Register what `name` (a component) ends when an incarnation ends."""
        self._hooks.append((name, hook))

    async def current(self, instance_id: str) -> str | None:
        """The live incarnation of `instance_id`, or None when there is no live instance."""
        async with self._db.session() as s:
            return await s.scalar(
                select(m.Instance.incarnation).where(
                    m.Instance.id == instance_id, m.Instance.deleted_at.is_(None)
                )
            )

    async def end(
        self, instance_id: str, incarnation: str, *, actor: str, reason: str
    ) -> list[str]:
        """Run every hook for the ended incarnation; returns the names of hooks that failed."""
        ended = EndedIncarnation(instance_id, incarnation, actor, reason)
        failed = []
        for name, hook in self._hooks:
            try:
                await hook(ended)
            except Exception:
                log.exception(
                    "ending incarnation %s of %s: %s failed",
                    incarnation,
                    instance_id,
                    name,
                    extra={"instance_id": instance_id, "incarnation": incarnation},
                )
                failed.append(name)
        return failed
