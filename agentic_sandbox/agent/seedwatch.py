"""Noticing that this guest was given another instance's seed (a clone, a warm-pool hand-off).

A guest restored from a memory state wakes up as the guest it was saved from; its new identity
is on its new seed. The watcher compares a cheap fingerprint of the seed disk (a 64 KiB
O_DIRECT read) every quarter second, and mounts and reads the seed only when the fingerprint
changed; what it read is kept for the identity switch, which must not mount it again (every
mount costs hand-off time inside an emulated guest). `check()` does the same at once: the agent
calls it before every (re)connect, so it never reconnects under an identity its seed no longer
names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agentic_sandbox.agent import identity

log = logging.getLogger("agent")

SEED_POLL_SECONDS = 0.25


class SeedWatcher:
    def __init__(self) -> None:
        self.fingerprint: bytes | None = None
        self._fresh: identity.SeedIdentity | None = None  # read, not yet taken on
        self._read_once = False
        self.changed = asyncio.Event()  # a seed naming another instance arrived

    async def _fingerprint(self) -> bytes | None:
        return await asyncio.to_thread(identity.seed_fingerprint)

    async def check(self) -> identity.SeedIdentity | None:
        """The seed's identity when it is new (or never read), else None; reads the seed only
        when its fingerprint changed."""
        if self._fresh is not None:
            fresh, self._fresh = self._fresh, None
            return fresh
        fp = await self._fingerprint()
        if self._read_once and fp == self.fingerprint:
            return None
        seed = await asyncio.to_thread(identity.read_seed)
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
            await asyncio.sleep(SEED_POLL_SECONDS)
            fp = await self._fingerprint()
            if fp is None or fp == self.fingerprint:
                continue
            seed = await asyncio.to_thread(identity.read_seed)
            if seed is None:
                continue  # the new medium is not readable yet: look again on the next tick
            self.fingerprint = fp
            self._read_once = True
            if not is_mine(seed):
                log.warning("a new seed names instance %s: dropping the link", seed.instance_id)
                self._fresh = seed
                self.changed.set()
                notify()
