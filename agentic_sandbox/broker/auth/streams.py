"""Every open WebSocket and SSE stream, by the credentials that opened it.

A stream handler opens a lease before it starts streaming (`streams.open(principal)`) and
releases it when it ends. Revoking a credential (`revoke("token:<id>")`, done by `AuthService`
when a token or key is revoked or a dashboard session signs out) ends every stream leased under
it at once: the lease is marked revoked and each stream's `on_revoke` callback runs right away,
synchronously, so a revoked controller's next keystroke is never applied. A credential that
expires ends its streams at the moment it expires, by a timer on the lease.

Bounded: at most `max_per_credential` live streams per credential key (the next one is refused
with `TooManyStreams`); the total is bounded by the HTTP connection caps.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

from agentic_sandbox.broker.auth.principal import Principal

log = logging.getLogger(__name__)

RevokeCallback = Callable[[str], None]


class TooManyStreams(Exception):
    """This credential already holds the maximum number of open streams."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"this credential already has {limit} open streams (the maximum)")
        self.limit = limit


class StreamLease:
    """One open stream's registration. `revoked` is set (and callbacks run) on revocation."""

    def __init__(self, registry: LiveStreams, keys: tuple[str, ...], kind: str) -> None:
        self._registry = registry
        self.keys = keys
        self.kind = kind
        self.revoked = asyncio.Event()
        self.reason = ""
        self._callbacks: list[RevokeCallback] = []
        self._timer: asyncio.TimerHandle | None = None
        self.released = False

    def on_revoke(self, callback: RevokeCallback) -> None:
        """Run `callback(reason)` on revocation (at once, if the lease is already revoked)."""
        if self.revoked.is_set():
            callback(self.reason)
            return
        self._callbacks.append(callback)

    def _revoke(self, reason: str) -> None:
        if self.revoked.is_set():
            return
        self.reason = reason
        self.revoked.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("ending a %s stream after revocation failed", self.kind)
        self.release()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._registry._forget(self)

    def __enter__(self) -> StreamLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LiveStreams:
    def __init__(self, *, max_per_credential: int) -> None:
        self.max_per_credential = max_per_credential
        self._by_key: dict[str, set[StreamLease]] = {}

    def open(self, principal: Principal, kind: str) -> StreamLease:
        """Register a stream opened by `principal` (`kind` names it in logs: ws, sse …)."""
        keys = principal.credential_keys
        for key in keys:
            if len(self._by_key.get(key, ())) >= self.max_per_credential:
                raise TooManyStreams(self.max_per_credential)
        lease = StreamLease(self, keys, kind)
        for key in keys:
            self._by_key.setdefault(key, set()).add(lease)
        if principal.expires_at is not None:
            delay = (principal.expires_at - dt.datetime.now(dt.UTC)).total_seconds()
            loop = asyncio.get_running_loop()
            lease._timer = loop.call_later(max(0.0, delay), lease._revoke, "credential expired")
        return lease

    def revoke(self, key: str, reason: str) -> int:
        """End every stream opened with credential `key`; returns how many there were."""
        leases = tuple(self._by_key.get(key, ()))
        for lease in leases:
            lease._revoke(reason)
        if leases:
            log.info(
                "ended %d stream(s) of a revoked credential",
                len(leases),
                extra={"credential": key, "reason": reason},
            )
        return len(leases)

    def count(self, key: str | None = None) -> int:
        if key is not None:
            return len(self._by_key.get(key, ()))
        return len({lease for leases in self._by_key.values() for lease in leases})

    def _forget(self, lease: StreamLease) -> None:
        for key in lease.keys:
            leases = self._by_key.get(key)
            if leases is None:
                continue
            leases.discard(lease)
            if not leases:
                del self._by_key[key]
