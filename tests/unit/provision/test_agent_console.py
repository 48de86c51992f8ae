"""The enrolment's console watch on console text recorded from real guests (TCG, this
project's image): `agent-crash-console.txt` is the tail of a guest whose agent's `main()` fails
to import (tests/e2e/provision/test_installed_package_e2e.py makes it), with its ANSI colours,
carriage returns and a login prompt in front of the first traceback line;
`agent-enrolled-console.txt` a healthy guest's, up to its agent's `connected` line."""

from __future__ import annotations

import random
from pathlib import Path

from agentic_sandbox.provision.agent_console import AGENT_IDENTIFIER, AgentConsoleWatch

DATA = Path(__file__).with_name("data")
CRASH = (DATA / "agent-crash-console.txt").read_bytes()
ENROLLED = (DATA / "agent-enrolled-console.txt").read_bytes()


def feed_in_chunks(data: bytes, seed: int) -> tuple[AgentConsoleWatch, int | None]:
    """Feed `data` in random chunks (as the poll reads it); where the verdict came, if any."""
    rng = random.Random(seed)
    watch = AgentConsoleWatch()
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 700)
        if watch.feed(data[pos : pos + step]) is not None:
            return watch, pos + step
        pos += step
    return watch, None


def test_an_import_error_at_start_is_a_crash_with_the_tracebacks_last_lines() -> None:
    crash = AgentConsoleWatch().feed(CRASH)
    assert crash is not None and crash.exception == "ImportError" and crash.starts == 1
    cause = crash.cause()
    assert cause.startswith("the agent exits at start with ImportError"), cause
    assert (
        cause.splitlines()[-1]
        .strip()
        .startswith("ImportError: cannot import name 'no_such_module' from 'agentic_sandbox.agent'")
    ), cause
    assert 'agentic_sandbox/agent/main.py", line 63, in main' in cause, cause
    assert "^^^" not in cause and "\x1b" not in cause and "\r" not in cause, cause
    assert "cloud-init" not in cause  # only the agent's own lines


def test_the_verdict_comes_when_the_exception_line_is_complete_however_it_is_read() -> None:
    end = CRASH.rindex(b"ImportError") + len(CRASH[CRASH.rindex(b"ImportError") :].split(b"\n")[0])
    for seed in range(20):
        _, at = feed_in_chunks(CRASH, seed)
        assert at is not None and at > end, (seed, at, end)  # not before the line is whole
    assert AgentConsoleWatch().feed(CRASH[:end]) is None  # the line is not finished yet


def test_a_healthy_guest_is_no_crash() -> None:
    for seed in range(5):
        watch, at = feed_in_chunks(ENROLLED, seed)
        assert at is None and watch.starts == 1


def test_other_programs_tracebacks_are_not_the_agents() -> None:
    as_cloud_init = CRASH.replace(AGENT_IDENTIFIER.encode(), b"cloud-init")
    assert AgentConsoleWatch().feed(ENROLLED + as_cloud_init) is None


def test_repeated_restarts_without_a_traceback_are_a_crash_loop() -> None:
    """An agent that exits at once with a message (a bad configuration) restarts every 2 s:
    the third start is the verdict, with the last finished start's output as the cause."""
    watch = AgentConsoleWatch()
    lines = [
        f"[  {70 + i * 3}.10{i}] {AGENT_IDENTIFIER}[{400 + i}]: agent-client: "
        "config: server_name is empty\r\n"
        for i in range(3)
    ]
    assert watch.feed(ENROLLED) is None
    assert watch.feed(lines[0].encode()) is None
    crash = watch.feed(lines[1].encode() + lines[2].encode())
    assert crash is not None and crash.starts == 4 and crash.exception == ""
    assert crash.cause().splitlines()[-1].strip() == "agent-client: config: server_name is empty"


def test_a_traceback_the_running_agent_logs_is_not_a_crash() -> None:
    logged = "".join(
        f"[  120.{i:06d}] {AGENT_IDENTIFIER}[310]: {text}\r\n"
        for i, text in enumerate(
            [
                "2026-12-01 10:27:20,100 ERROR   agent: a session failed",
                "Traceback (most recent call last):",
                '  File "/opt/agentic-sandbox/app/agentic_sandbox/agent/session.py", line 9',
                "OSError: [Errno 5] Input/output error",
                "2026-12-01 10:27:21,000 INFO    agent: connected to 10.0.2.2:37239",
            ]
        )
    )
    assert AgentConsoleWatch().feed(ENROLLED + logged.encode()) is None


def test_the_agents_unit_logs_to_the_console_under_the_name_the_watch_reads() -> None:
    from agentic_sandbox.provision.cloudinit import agent_unit

    unit = agent_unit("/opt/agentic-sandbox/venv/bin/python").splitlines()
    assert f"SyslogIdentifier={AGENT_IDENTIFIER}" in unit
    assert "StandardOutput=journal+console" in unit and "StandardError=journal+console" in unit
