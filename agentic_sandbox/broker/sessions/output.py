"""The output pipeline: redaction → ring → recording → quiet timer → HITL.

This is the hot path. Per output message from the agent: one redaction pass (skipped when the
instance has no secrets), one slice copy into the ring, one buffered write into the recording,
a counter, and waking the client writers and followers — the pipeline never waits for a client.
There is exactly one way into the ring, `append`, so every byte is counted
(`sandbox_session_output_bytes_total`), recorded and fanned out alike, whether it came from the
agent, was masked at the end of the stream or released by a secrets refresh.

HITL is off the hot path: an append arms one timer when none is running, and once output has
been quiet for `session_hitl_quiet_ms`, the last line is matched against prompt
patterns (`hitl.py`), a prompt is published (`session.prompt`) and the prompt listeners (the task
layer) are called. The quiet moment also keeps the lazily rendered screen warm.

Redaction (`redaction.py`) is stateful across writes: bytes that may begin a secret are held
until what follows decides them. Where the stream ends or breaks (`end_stream`, `gap`) held bytes
are masked; where the link drops they are forgotten (`StreamRedactor.drop_held`): the agent
resends them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from agentic_sandbox.broker.config import Settings
from agentic_sandbox.broker.observability.events import EventBus
from agentic_sandbox.broker.observability.metrics import Metrics
from agentic_sandbox.broker.sessions.contract import Prompt, PromptListener
from agentic_sandbox.broker.sessions.hitl import TAIL_BYTES, detect_prompt
from agentic_sandbox.broker.sessions.screen import INCREMENTAL_MAX
from agentic_sandbox.broker.sessions.session import HubSession, publish

log = logging.getLogger(__name__)


class OutputPipeline:
    def __init__(self, settings: Settings, metrics: Metrics, events: EventBus) -> None:
        self._quiet = settings.session_hitl_quiet_ms / 1000.0
        self._output_bytes = metrics.session_output_bytes
        self._prompts = metrics.hitl_prompts
        self._events = events
        self._listeners: list[PromptListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def add_prompt_listener(self, listener: PromptListener) -> None:
        self._listeners.append(listener)

    # ---- into the ring ---------------------------------------------------------------------
    def feed(self, sess: HubSession, data: bytes) -> None:
        """Output that continues the stream at `sess.ring.end` plus what redaction holds."""
        out = sess.redactor.feed(data) if sess.redactor.active else data
        if out:
            self.append(sess, out)

    def append(self, sess: HubSession, data: bytes) -> None:
        """The one way into a session's ring."""
        start = sess.ring.end
        sess.ring.append(data)
        self._output_bytes.inc(len(data))
        if sess.recording is not None:
            sess.recording.output(start, data)
        loop = self._loop or asyncio.get_running_loop()
        sess.last_output = loop.time()
        if sess.quiet_timer is None and not sess.ended:
            sess.quiet_timer = loop.call_later(self._quiet, self._on_quiet, sess)
        sess.notify()

    def gap(self, sess: HubSession, expected: int, offset: int) -> None:
        """The stream continues at `offset`, past `expected`: the agent's ring no longer held
        what lay between."""
        log.warning(
            "session %s: output gap %d..%d (the agent's ring no longer held it)",
            sess.id,
            expected,
            offset,
            extra={"session_id": sess.id},
        )
        held = sess.redactor.mask_held()  # what it began is lost: it may be a secret's start
        if held:
            self.append(sess, held)
        sess.ring.reset(offset)

    def end_stream(self, sess: HubSession) -> None:
        """The session ends: what redaction holds is masked (it began a secret the stream
        never finished) and HITL stops. Call before the state says ended."""
        leftover = sess.redactor.mask_held()
        if leftover:
            self.append(sess, leftover)
        if sess.quiet_timer is not None:
            sess.quiet_timer.cancel()
            sess.quiet_timer = None

    def set_secrets(self, sess: HubSession, values: Iterable[str]) -> None:
        """The secrets to redact from now on; held bytes that no longer start one are
        released at once."""
        sess.redactor.set(values)
        if sess.redactor.held:
            released = sess.redactor.feed(b"")
            if released:
                self.append(sess, released)

    # ---- quiet: HITL -----------------------------------------------------------------------
    def _on_quiet(self, sess: HubSession) -> None:
        sess.quiet_timer = None
        if sess.ended:
            return
        loop = self._loop or asyncio.get_running_loop()
        idle = loop.time() - sess.last_output
        if idle < self._quiet:
            sess.quiet_timer = loop.call_later(self._quiet - idle, self._on_quiet, sess)
            return
        if sess.screen is not None and 0 < sess.ring.end - sess.screen.offset <= INCREMENTAL_MAX:
            sess.screen.catch_up(sess.ring)  # keep the screen warm while idle
        if sess.prompt_checked == sess.ring.end:
            return
        sess.prompt_checked = sess.ring.end
        text = detect_prompt(sess.ring.tail(TAIL_BYTES))
        if text is None:
            return
        prompt = Prompt(session_id=sess.id, text=text, offset=sess.ring.end)
        self._prompts.inc()
        publish(
            self._events,
            sess,
            "session.prompt",
            actor=f"agent:{sess.instance_id}",
            data={"text": text, "offset": prompt.offset},
        )
        for listener in list(self._listeners):
            try:
                listener(prompt)
            except Exception:
                log.exception("prompt listener failed")
