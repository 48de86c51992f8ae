"""Noticing that this guest was given another instance's seed (a clone, a warm-pool hand-off).

A guest restored from a memory state wakes up as the guest it was saved from; its new identity
is on its new seed. The watcher reads the seed disk's head (one 64 KiB O_DIRECT read,
`identity.read_seed_head`) every quarter second: its fingerprint says whether the seed changed,
and the identity record in its system area says who this guest now is, with no mount. Only a
seed without that record (made by an older server) is mounted and read, and only when its
fingerprint changed. What was read is kept for the identity switch, which must not read it
again. `check()` does the same at once: the agent calls it as soon as a link fails and before
every (re)connect, so it never reconnects under an identity its seed no longer names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agentic_sandbox.agent import identity

log = logging.getLogger("agent")

SEED_POLL_SECONDS = 0.25
# A warm-pool member standing by is paused nearly all its life, and once resumed its new seed
# is the hand-off's first step: it looks more often (one read costs 10-20 ms of an emulated vCPU).
STANDBY_POLL_SECONDS = 0.05


class SeedWatcher:
    def __init__(self) -> None:
        self.fingerprint: bytes | None = None
        self._fresh: identity.SeedIdentity | None = None  # read, not yet taken on
        self._read_once = False
        self.changed = asyncio.Event()  # a seed naming another instance arrived
        self.standing_by = False  # a warm-pool member's: look at `STANDBY_POLL_SECONDS`

    async def _head(self) -> identity.SeedHead | None:
        """The seed's head; its record is parsed only when it is not the seed already read."""
        known = self.fingerprint if self._read_once else None
        return await asyncio.to_thread(identity.read_seed_head, known)

    @staticmethod
    async def _identity(head: identity.SeedHead | None) -> identity.SeedIdentity | None:
        if head is not None and head.identity is not None:
            return head.identity
        # a seed without its record, or none of the usual devices held one (blkid looks)
        return await asyncio.to_thread(identity.read_seed)

    async def check(self) -> identity.SeedIdentity | None:
        """The seed's identity when it is new (or never read), else None; reads the seed only
        when its fingerprint changed."""
        if self._fresh is not None:
            fresh, self._fresh = self._fresh, None
            return fresh
        head = await self._head()
        fp = head.fingerprint if head is not None else None
        if self._read_once and fp == self.fingerprint:
            return None
        seed = await self._identity(head)
        if seed is None:
            return None  # not readable yet (mid media change): look again next time
        self.fingerprint = fp
        self._read_once = True
        return seed

    async def watch(
        self, is_mine: Callable[[identity.SeedIdentity], bool], notify: Callable[[], None]
    ) -> None:
        """Poll for ever; when a changed seed names another instance than ours, keep it for
        `check()`, set `changed` and call `notify()`."""
        while True:
            await asyncio.sleep(STANDBY_POLL_SECONDS if self.standing_by else SEED_POLL_SECONDS)
            head = await self._head()
            if head is None or head.fingerprint == self.fingerprint:
                continue
            fp = head.fingerprint
            seed = await self._identity(head)
            if seed is None:
                continue  # the new medium is not readable yet: look again on the next tick
            self.fingerprint = fp
            self._read_once = True
            if not is_mine(seed):
                log.warning("a new seed names instance %s: dropping the link", seed.instance_id)
                self._fresh = seed
                self.changed.set()
                notify()
