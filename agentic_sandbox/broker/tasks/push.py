"""Push notifications: every event of a task is POSTed to each of its configured webhooks.

The body is the A2A StreamResponse (the same object a stream carries), with the config's
token in `X-A2A-Notification-Token` and, when the config has `authentication`, an
`Authorization: <scheme> <credentials>` header. Each webhook gets its events in order from
its own bounded queue; a failed POST (network error, timeout, 5xx, 408, 429) is retried with
exponential backoff and jitter up to `push_max_attempts`; the final failure is recorded as a
`task.push_failed` event and in the audit log. Tokens and credentials are stored sealed.

Destinations are checked (`broker.tasks.destinations`): a URL whose host is, or resolves to, a
loopback, private, link-local, metadata or otherwise non-public address is refused when the
config is set, and again at every connection (the client connects to the addresses that were
checked), unless `push_allow_networks` names it. What a failure records — events, the audit
log, the API — is one of a few fixed texts (`HTTP <status>`, `destination not allowed`,
`delivery failed (no HTTP answer)`): never an address, a port or an OS error, which would make
the server a port scanner for whoever sets a webhook. The server log has the detail.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client import Counter

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.audit import AuditLog
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.secrets.vault import Vault, VaultError
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.broker.tasks.destinations import (
    CheckedResolver,
    DestinationPolicy,
    DestinationRefused,
    literal_address,
)
from agentic_sandbox.broker.tasks.errors import InvalidPushConfig
from agentic_sandbox.broker.tasks.live import LiveTask, StreamEvent
from agentic_sandbox.broker.tasks.store import TaskStore

log = logging.getLogger(__name__)

PUSH_ACTOR = "system:push"
QUEUE_LIMIT = 1000
MAX_TOKEN = 1024
RETRYABLE = frozenset({408, 425, 429})
TOKEN_HEADER = "X-A2A-Notification-Token"
ANSWER_BYTES = 64 * 1024  # of a receiver's answer body read (the rest is not)
NOT_ALLOWED = "destination not allowed"
NO_ANSWER = "delivery failed (no HTTP answer)"


@dataclass
class PushConfigView:
    """A push config as the API shows it (credentials are never shown again)."""

    task_id: str
    id: str
    url: str
    token: str | None
    scheme: str | None


@dataclass
class _Target:
    task_id: str
    instance_id: str
    owner: str
    config_id: str
    url: str
    token: str | None
    authorization: str | None
    queue: asyncio.Queue[StreamEvent] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))
    worker: asyncio.Task[None] | None = None
    dropped: int = 0


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidPushConfig("url must be an absolute http:// or https:// URL", field="url")
    if parts.username or parts.password:
        raise InvalidPushConfig("url must not carry credentials; use authentication", field="url")
    if len(url) > 2048:
        raise InvalidPushConfig("url is longer than 2048 characters", field="url")
    return url


def shown_url(url: str) -> str:
    """The URL without its query (which may carry secrets), for events and logs."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


class PushNotifier:
    def __init__(
        self,
        *,
        store: TaskStore,
        vault: Vault,
        events: EventBus,
        audit: AuditLog,
        metrics: Metrics,
        settings: Settings,
    ) -> None:
        self.store = store
        self.vault = vault
        self.events = events
        self.audit = audit
        self.settings = settings
        self._targets: dict[str, dict[str, _Target]] = {}
        self._http: aiohttp.ClientSession | None = None
        self.destinations = CheckedResolver(DestinationPolicy(settings.push_allow_networks))
        self.deliveries = Counter(
            "sandbox_task_push_total",
            "Push notification deliveries by outcome (ok, retry, failed, dropped)",
            ["outcome"],
            registry=metrics.registry,
        )

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(
            # the connector connects to the addresses its resolver checked
            connector=aiohttp.TCPConnector(resolver=self.destinations),
            timeout=aiohttp.ClientTimeout(total=self.settings.push_timeout_seconds),
            headers={"User-Agent": "agentic-sandbox-push/1"},
        )
        for row in await self.store.push_configs_for_open_tasks():
            task = await self.store.get(row.task_id)
            if task is not None:
                self._add(row, task.instance_id)

    async def stop(self) -> None:
        workers = [t.worker for ts in self._targets.values() for t in ts.values() if t.worker]
        for w in workers:
            w.cancel()
        for w in workers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w
        self._targets.clear()
        if self._http is not None:
            await self._http.close()
        await self.destinations.close()

    # ---- configs --------------------------------------------------------------------------
    def _seal(self, value: str) -> str:
        return base64.b64encode(self.vault.seal(value.encode())).decode()

    def _open(self, value: str | None) -> str | None:
        if not value:
            return None
        try:
            return self.vault.open(base64.b64decode(value)).decode()
        except (VaultError, ValueError):
            log.warning("a push config secret cannot be opened with this data directory's key")
            return None

    async def put(
        self,
        *,
        task_id: str,
        instance_id: str,
        owner: str,
        url: str,
        token: str | None,
        config_id: str | None,
        scheme: str | None,
        credentials: str | None,
        deliver: bool = True,
    ) -> PushConfigView:
        """Store a config (replacing one with the same id). `deliver=False` for a task that
        has ended: the config is kept (A2A allows setting one) but nothing will be sent."""
        check_url(url)
        try:
            await self.destinations.check_url(url)
        except DestinationRefused as exc:
            raise InvalidPushConfig(str(exc), field="url") from None
        if token is not None and len(token) > MAX_TOKEN:
            raise InvalidPushConfig(f"token is longer than {MAX_TOKEN} characters", field="token")
        if scheme is not None and (not scheme.strip() or " " in scheme.strip()):
            raise InvalidPushConfig("authentication.scheme must be one word", field="scheme")
        cid = config_id or str(uuid.uuid4())
        if len(cid) > 64:
            raise InvalidPushConfig("id is longer than 64 characters", field="id")
        auth: dict[str, Any] | None = None
        if scheme:
            auth = {"scheme": scheme.strip()}
            if credentials:
                auth["credentials_sealed"] = self._seal(credentials)
        row = m.PushConfig(
            task_id=task_id,
            id=cid,
            owner=owner,
            url=url,
            token=self._seal(token) if token else None,
            authentication=auth,
        )
        await self.store.put_push_config(row)
        self._remove(task_id, cid)
        if deliver:
            self._add(row, instance_id)
        return PushConfigView(task_id, cid, url, token, auth["scheme"] if auth else None)

    def view(self, row: m.PushConfig) -> PushConfigView:
        scheme = (row.authentication or {}).get("scheme")
        return PushConfigView(row.task_id, row.id, row.url, self._open(row.token), scheme)

    async def delete(self, task_id: str, config_id: str) -> bool:
        self._remove(task_id, config_id)
        return await self.store.delete_push_config(task_id, config_id)

    def _add(self, row: m.PushConfig, instance_id: str) -> None:
        auth = row.authentication or {}
        authorization = None
        if auth.get("scheme"):
            creds = self._open(auth.get("credentials_sealed"))
            authorization = f"{auth['scheme']} {creds}" if creds else None
        target = _Target(
            task_id=row.task_id,
            instance_id=instance_id,
            owner=row.owner,
            config_id=row.id,
            url=row.url,
            token=self._open(row.token),
            authorization=authorization,
        )
        target.worker = asyncio.ensure_future(self._work(target))
        self._targets.setdefault(row.task_id, {})[row.id] = target

    def _remove(self, task_id: str, config_id: str) -> None:
        target = self._targets.get(task_id, {}).pop(config_id, None)
        if target is not None and target.worker is not None:
            target.worker.cancel()
        if task_id in self._targets and not self._targets[task_id]:
            del self._targets[task_id]

    def has_targets(self, task_id: str) -> bool:
        return bool(self._targets.get(task_id))

    # ---- delivery -------------------------------------------------------------------------
    def on_event(self, live: LiveTask, event: StreamEvent) -> None:
        for target in tuple(self._targets.get(live.id, {}).values()):
            try:
                target.queue.put_nowait(event)
            except asyncio.QueueFull:
                target.dropped += 1
                self.deliveries.labels("dropped").inc()

    async def _work(self, target: _Target) -> None:
        while True:
            event = await target.queue.get()
            await self._deliver(target, event)
            if _is_terminal(event) and target.queue.empty():
                # the task ended: nothing more will come for this webhook
                tasks = self._targets.get(target.task_id, {})
                if tasks.get(target.config_id) is target:
                    del tasks[target.config_id]
                    if not tasks:
                        self._targets.pop(target.task_id, None)
                return

    async def _deliver(self, target: _Target, event: StreamEvent) -> None:
        assert self._http is not None
        s = self.settings
        headers = {"Content-Type": "application/json"}
        if target.token:
            headers[TOKEN_HEADER] = target.token
        if target.authorization:
            headers["Authorization"] = target.authorization
        body = json.dumps(event, separators=(",", ":")).encode()
        host = urlsplit(target.url).hostname or ""
        delay = s.push_backoff_initial_seconds
        error = ""
        for attempt in range(1, s.push_max_attempts + 1):
            retryable = True
            why = ""
            try:
                if literal_address(host):  # (names are checked by the connector's resolver)
                    self.destinations.policy.check_address(host)
                async with self._http.post(
                    target.url, data=body, headers=headers, allow_redirects=False
                ) as resp:
                    await resp.content.read(ANSWER_BYTES)
                    if 200 <= resp.status < 300:
                        self.deliveries.labels("ok").inc()
                        return
                    error = f"HTTP {resp.status}"
                    retryable = resp.status >= 500 or resp.status in RETRYABLE
            except DestinationRefused:
                error, retryable = NOT_ALLOWED, False
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                error, why = NO_ANSWER, f"{type(exc).__name__}: {exc}".strip()
            if not retryable or attempt == s.push_max_attempts:
                self._record_failure(target, event, attempt, error, why)
                return
            self.deliveries.labels("retry").inc()
            await asyncio.sleep(min(s.push_backoff_max_seconds, delay * random.uniform(0.8, 1.2)))
            delay = min(s.push_backoff_max_seconds, delay * 2)

    def _record_failure(
        self, target: _Target, event: StreamEvent, attempts: int, error: str, why: str = ""
    ) -> None:
        """`error` is one of the fixed texts (events and the audit log show it); `why`, the
        client's own error, goes to the server log only."""
        self.deliveries.labels("failed").inc()
        kind = next(iter(event), "unknown")
        url = shown_url(target.url)
        log.warning(
            "push notification for task %s to %s failed after %d attempts: %s%s",
            target.task_id,
            url,
            attempts,
            error,
            f" ({why})" if why else "",
        )
        detail = {"config_id": target.config_id, "url": url, "attempts": attempts, "event": kind}
        self.events.publish(
            "task.push_failed",
            actor=PUSH_ACTOR,
            instance_id=target.instance_id,
            task_id=target.task_id,
            owner=target.owner,
            data={**detail, "error": error},
        )
        self.audit.record(
            PUSH_ACTOR,
            "task.push",
            "task",
            target.task_id,
            outcome="failed",
            cause=error,
            detail=detail,
        )


def _is_terminal(event: StreamEvent) -> bool:
    update = event.get("statusUpdate") or event.get("task")
    if not isinstance(update, dict):
        return False
    state = (update.get("status") or {}).get("state", "")
    return state in (
        "TASK_STATE_COMPLETED",
        "TASK_STATE_FAILED",
        "TASK_STATE_CANCELED",
        "TASK_STATE_REJECTED",
    )
