"""Refused requests and calls: rate-limited per remote address, audited once per window.

Every refusal of the HTTP surfaces (401/403) and of the agent link (Enroll, Connect, Renew)
goes through one `RefusalGate` before anything is written:

- **Rate limit** (`limit=True`, for callers without a valid credential): a token bucket per
  remote address (`auth_refusal_burst`, refilled at `auth_refusals_per_minute`). When it is
  empty, the verdict carries `retry_after` and the caller answers 429 (`Retry-After`) or gRPC
  `RESOURCE_EXHAUSTED` instead of 401. A request that carries a valid credential is never a
  refusal, so an address in the penalty box still serves its legitimate users (many callers
  share one address: everything on the host, every guest's forwarded link, a reverse proxy).
- **Aggregation**: per key (an address, or a credential id for a known caller refused a
  role) and kind of refusal (a bounded set: "invalid token", "no credentials", "role viewer
  below admin", `reused_token` …), the first refusal of a window
  (`auth_refusal_window_seconds`) is audited and published as it happens — so each distinct
  problem shows at once, with its details; the rest of the window is counted and written as
  one summary entry and one event with `count` when the window ends. A flood of N refusals
  costs at most two audit rows and two events per key, kind and window, and the counts add up
  to N (nothing is lost).

Bounded: at most `max_keys` (key, kind) windows are tracked (the least recently refused one
is summarised and dropped first); actions and reasons in a summary keep the `SAMPLE` most
frequent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentic_sandbox.broker.auth.ratelimit import RateLimiter
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus

log = logging.getLogger(__name__)

MAX_KEYS = 10_000
SAMPLE = 8
SWEEP_SECONDS = 1.0


@dataclass(frozen=True)
class Refusal:
    """One refused request or call, as the audit log and the event stream record it."""

    actor: str  # anonymous@ADDR, token:SUBJECT, agent:INSTANCE@PEER …
    action: str  # "GET /api/v2/admin/whoami", "agent.enroll" …
    subject_type: str
    subject_id: str
    reason: str
    event: str  # event type: auth.denied, agent.refused
    data: dict[str, Any] = field(default_factory=dict)
    instance_id: str | None = None
    kind: str = ""  # a bounded code for aggregation (default: the reason)


@dataclass(frozen=True)
class Verdict:
    retry_after: float  # > 0: rate-limited, answer 429 / RESOURCE_EXHAUSTED
    recorded: bool  # audited and published individually (a caller may log it too)

    @property
    def limited(self) -> bool:
        return self.retry_after > 0


@dataclass
class _Window:
    started: float
    first: Refusal
    more: int = 0  # refusals after the first, not yet summarised
    limited: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)

    def note(self, refusal: Refusal, limited: bool) -> None:
        self.more += 1
        self.limited += int(limited)
        for counter, value in ((self.reasons, refusal.reason), (self.actions, refusal.action)):
            if value in counter or len(counter) < SAMPLE:
                counter[value] += 1


class RefusalGate:
    def __init__(
        self,
        audit: AuditLog,
        events: EventBus,
        *,
        burst: int,
        per_minute: int,
        window_seconds: float,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._audit = audit
        self._events = events
        self._limiter = RateLimiter(per_minute, burst, max_keys=max_keys)
        self.window = window_seconds
        self._max_keys = max_keys
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._sweeper: asyncio.Task[None] | None = None

    def refuse(
        self, key: str, refusal: Refusal, *, limit: bool, now: float | None = None
    ) -> Verdict:
        """Count one refusal under `key`; rate-limit it too when `limit`."""
        now = time.monotonic() if now is None else now
        wait = self._limiter.take(key, now) if limit else 0.0
        wkey = f"{key}|{refusal.kind or refusal.reason}"
        win = self._windows.pop(wkey, None)
        if win is not None and now - win.started >= self.window:
            self._summarise(wkey, win)
            win = None
        if win is None:
            self._windows[wkey] = _Window(started=now, first=refusal)
            while len(self._windows) > self._max_keys:
                old_key, old = self._windows.popitem(last=False)
                self._summarise(old_key, old)
            self._record(refusal, limited=wait > 0)
            return Verdict(wait, recorded=True)
        win.note(refusal, wait > 0)
        self._windows[wkey] = win  # most recently refused last
        return Verdict(wait, recorded=False)

    def flush(self, now: float | None = None) -> None:
        """Summarise windows that have ended (all of them when `now` is None)."""
        for key in list(self._windows):
            win = self._windows[key]
            if now is None or now - win.started >= self.window:
                del self._windows[key]
                self._summarise(key, win)

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name="refusal-summaries")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self.flush()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_SECONDS, self.window / 2))
            try:
                self.flush(time.monotonic())
            except Exception:
                log.exception("summarising refusals failed")

    # ---- writing ---------------------------------------------------------------------------
    def _record(self, r: Refusal, *, limited: bool) -> None:
        cause = f"{r.reason} (rate-limited)" if limited else r.reason
        self._audit.denied(r.actor, r.action, r.subject_type, r.subject_id, cause)
        self._events.publish(
            r.event,
            actor=r.actor,
            instance_id=r.instance_id,
            data={**r.data, "count": 1, "rate_limited": limited},
        )

    def _summarise(self, key: str, win: _Window) -> None:
        if win.more == 0:
            return
        first = win.first
        summary = {
            "count": win.more,
            "rate_limited": win.limited,
            "window_seconds": self.window,
            "reasons": dict(win.reasons.most_common(SAMPLE)),
            "actions": dict(win.actions.most_common(SAMPLE)),
        }
        self._audit.record(
            first.actor,
            f"{first.event}.repeated",
            "refusals",
            key,
            outcome="denied",
            cause=f"{win.more} more refusal(s) within {self.window:g}s "
            f"({win.limited} rate-limited) after the first",
            detail=summary,
        )
        self._events.publish(
            first.event,
            actor=first.actor,
            instance_id=first.instance_id,
            data={**summary, "aggregated": True},
        )
