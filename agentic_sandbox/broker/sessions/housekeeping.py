"""The hub's periodic sweep (every 0.25 s), everything that must not run per output message:

- recordings are flushed (and checkpointed) a few times a second;
- a client stuck in one send for `session_client_stall_seconds` is disconnected
  (`sandbox_session_client_drops_total`): it never slows the PTY or the other clients;
- output offsets are written to the rows every 2 s (what a restarted server resumes from);
- the secrets bound to each instance are read again every 10 s, so a secret bound or changed
  after a session started is redacted from then on;
- an ended session is evicted `session_retain_seconds` after it ended, once nobody is attached
  or following (its row and recording remain).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions.clients import AttachedClient
from agentic_sandbox.broker.sessions.control import ControlArbiter
from agentic_sandbox.broker.sessions.output import OutputPipeline
from agentic_sandbox.broker.sessions.rows import SessionRows
from agentic_sandbox.broker.sessions.session import HubSession
from agentic_sandbox.broker.sessions.table import SessionTable

log = logging.getLogger(__name__)

HOUSEKEEPING_SECONDS = 0.25
OFFSET_PERSIST_SECONDS = 2.0
SECRETS_REFRESH_SECONDS = 10.0

SecretsOf = Callable[[str], Awaitable[dict[str, str]]]


class Housekeeping:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        table: SessionTable,
        rows: SessionRows,
        output: OutputPipeline,
        control: ControlArbiter,
        secrets_of: SecretsOf,
    ) -> None:
        self._stall = settings.session_client_stall_seconds
        self._retain = settings.session_retain_seconds
        self._drops = metrics.session_client_drops
        self._table = table
        self._rows = rows
        self._output = output
        self._control = control
        self._secrets_of = secrets_of
        self._last_offset_persist = 0.0
        self._last_secrets_refresh = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            try:
                await self.sweep(loop.time())
            except Exception:  # one bad sweep must not end them all
                log.exception("session housekeeping failed; it goes on")

    async def sweep(self, now: float) -> None:
        persist_offsets = now - self._last_offset_persist >= OFFSET_PERSIST_SECONDS
        if persist_offsets:
            self._last_offset_persist = now
        if now - self._last_secrets_refresh >= SECRETS_REFRESH_SECONDS:
            self._last_secrets_refresh = now
            await self.refresh_secrets()
        for sess in self._table.all():
            sess.flush_recording()
            for client in list(sess.clients.values()):
                since = client.sending_since
                if since is not None and now - since > self._stall:
                    self._drop_stuck(sess, client, now - since)
            if persist_offsets and sess.ring.end != sess.persisted_offset:
                sess.persisted_offset = sess.ring.end
                self._rows.persist(sess.id, output_offset=sess.ring.end)
            if (
                sess.ended
                and sess.ended_mono is not None
                and now - sess.ended_mono > self._retain
                and not sess.clients
                and not sess.followers
            ):
                self._evict(sess)

    async def refresh_secrets(self) -> None:
        """Secrets bound or changed after a session started are redacted from then on."""
        for instance_id in self._table.live_instances():
            values = (await self._secrets_of(instance_id)).values()
            for sess in self._table.live_of_instance(instance_id):
                self._output.set_secrets(sess, values)

    def _evict(self, sess: HubSession) -> None:
        sess.close_recording()
        sess.ring.release()
        sess.screen = None
        self._table.remove(sess)

    def _drop_stuck(self, sess: HubSession, client: AttachedClient, seconds: float) -> None:
        log.warning(
            "client %s of session %s stuck in a send for %.1fs; disconnecting it",
            client.id,
            sess.id,
            seconds,
            extra={"session_id": sess.id, "client": client.id, "subject": client.subject},
        )
        self._drops.inc()
        client.kick(f"stuck in a send for {seconds:.1f}s")
        self._control.detach(sess, client)
