"""Bad input on the session WebSocket: hypothesis-generated control frames, oversized frames,
unknown types. Each gets an `error` frame; the connection and the session stay healthy."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fixtures import AgentFactory
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess
from tests.support.sessions import SHELL, create_session

pytestmark = pytest.mark.timeout(600)

KNOWN = ["resize", "request_control", "release_control", "signal", "ping"]
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.one_of(
    # well-typed names with arbitrary fields
    st.builds(
        lambda t, extra: {"type": t, **extra},
        st.sampled_from(KNOWN),
        st.dictionaries(
            st.sampled_from(["cols", "rows", "force", "signal", "id", "x"]), json_values, max_size=3
        ),
    ),
    st.dictionaries(st.text(max_size=12), json_values, max_size=5),  # anything JSON-ish
    json_values,
)
frames = st.one_of(
    messages.map(lambda m: json.dumps(m, allow_nan=True)),
    st.text(max_size=200),  # not JSON at all
)


async def _healthy(ctl: PtyClient, marker: str) -> None:
    await ctl.send_input(f"echo {marker}-$((6*7))\r".encode())
    await ctl.wait_output(f"{marker}-42".encode(), timeout=20)


async def test_control_frames_fuzzed_by_hypothesis(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    tok = server.admin_token
    loop = asyncio.get_running_loop()
    ctl = await PtyClient.connect(server.ws_url, sid, tok, role="control", from_offset=0)
    fuzz = await PtyClient.connect(server.ws_url, sid, tok, role="observe")
    sent = 0

    async def send_all(batch: list[str]) -> None:
        nonlocal sent
        before = len(fuzz.controls)
        for text in batch:
            await fuzz.send_text(text)
        await fuzz.send_json({"type": "ping", "id": f"sync-{sent}"})
        await fuzz.wait_control(
            "pong", pred=lambda m: m.get("id") == f"sync-{sent}", after=before, timeout=20
        )
        sent += 1

    # Hypothesis drives a synchronous test body; the frames go through the running loop.
    import threading

    errors: list[BaseException] = []

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(st.lists(frames, min_size=1, max_size=8))
    def run(batch: list[str]) -> None:
        asyncio.run_coroutine_threadsafe(send_all(batch), loop).result(60)

    def worker() -> None:
        try:
            run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.05)
    thread.join()
    try:
        assert not errors, errors[0]
        assert sent >= 100, f"hypothesis ran only {sent} examples"
        assert not fuzz.closed.is_set(), "the fuzzed connection was closed"
        assert fuzz.errors(), "malformed frames got no error frames"
        codes = {e["code"] for e in fuzz.errors()}
        assert codes <= {
            "bad-json",
            "bad-message",
            "unknown-type",
            "frame-too-large",
            "not-controller",
            "forbidden",
            "control-held",
            "session-ended",
        }, codes
        # The session is healthy: whoever controls it can still type (the fuzzer may have
        # taken control with force, so take it back first).
        await ctl.send_json({"type": "request_control", "force": True})
        await ctl.wait_control("role", pred=lambda r: r["role"] == "controller")
        await _healthy(ctl, "after-fuzz")
    finally:
        await ctl.close()
        await fuzz.close()


async def test_oversized_and_unknown_frames_get_errors(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    server = sandbox_server
    agent = agent_factory(server)
    sid = create_session(server, agent.instance_id, SHELL)
    async with await PtyClient.connect(
        server.ws_url, sid, server.admin_token, role="control", from_offset=0
    ) as ctl:
        cases: list[tuple[str | bytes, str]] = [
            ('{"type": "teleport"}', "unknown-type"),
            ("not json at all", "bad-json"),
            ("[1, 2, 3]", "bad-message"),
            ('{"type": "resize", "cols": "80", "rows": 24}', "bad-message"),
            ('{"type": "resize", "cols": 0, "rows": 24}', "bad-message"),
            ('{"type": "resize", "cols": 80, "rows": 24, "extra": 1}', "bad-message"),
            ('{"type": "signal", "signal": "STOP"}', "bad-message"),
            ('{"type": "request_control", "force": "yes"}', "bad-message"),
            (json.dumps({"type": "ping", "id": "x" * 20_000}), "frame-too-large"),
            ("{" * 5000, "bad-json"),
            (b"A" * (200 * 1024), "frame-too-large"),  # an input frame over 64 KiB
        ]
        for frame, code in cases:
            before = len(ctl.controls)
            if isinstance(frame, bytes):
                await ctl.send_input(frame)
            else:
                await ctl.send_text(frame)
            err = await ctl.wait_control("error", after=before, timeout=10)
            assert err["code"] == code, (frame[:60], err)
        assert b"AAAAAAAA" not in ctl.data  # the oversized input never reached the PTY
        assert not ctl.closed.is_set()
        await _healthy(ctl, "still-fine")
