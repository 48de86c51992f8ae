"""Exec against a real server and a real host agent (as root, on this machine's cgroups):
output and exit, stdin, signals, the streaming form, limits and bad input with named errors,
roles and owners, loadout ceilings, concurrency limits, and a link that drops mid-exec."""

from __future__ import annotations

import base64
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.exec.helpers import (
    assert_cleaned_up,
    ok,
    processes_with,
    run,
    stream_lines,
    wait_until,
)
from tests.support.agents import AgentProcess
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(240)

ENFORCED = "cgroup-v1" if os.geteuid() == 0 else "none"


def problem_field(body: Any) -> str:
    assert isinstance(body, dict) and body.get("errors"), body
    return str(body["errors"][0]["field"])


def test_stdout_stderr_and_exit_code_come_back_separately(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = ok(
        sandbox_server,
        agent.instance_id,
        {"argv": ["sh", "-c", "echo to-out; echo to-err >&2; exit 3"]},
    )
    assert out["exit_code"] == 3 and out["signal"] is None and out["reason"] is None
    assert out["stdout"] == {"data": "to-out\n", "bytes": 7, "truncated": False}
    assert out["stderr"] == {"data": "to-err\n", "bytes": 7, "truncated": False}
    assert out["enforcement"] == ENFORCED
    assert out["usage"]["output_bytes"] == 14
    assert out["usage"]["cpu_seconds"] > 0 and out["usage"]["peak_memory_bytes"] > 0
    assert out["duration_seconds"] > 0 and out["pid"] > 0


def test_argv_is_not_a_shell_string_env_cwd_and_user(
    sandbox_server: ServerProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    out = ok(
        sandbox_server,
        agent.instance_id,
        {
            "argv": ["printf", "%s|%s|", "$HOME; echo injected", "two words"],
            "env": {"GREETING": "hi there"},
        },
    )
    assert out["stdout"]["data"] == "$HOME; echo injected|two words|"
    out = ok(
        sandbox_server,
        agent.instance_id,
        {
            "argv": ["sh", "-c", 'echo "$GREETING" "$(pwd)" "$(id -un)"'],
            "env": {"GREETING": "hi"},
            "cwd": str(tmp_path),
            "user": "nobody",
        },
    )
    assert out["stdout"]["data"] == f"hi {tmp_path} nobody\n"


def test_stdin_as_text_and_as_exact_bytes(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = ok(sandbox_server, agent.instance_id, {"argv": ["cat"], "stdin": "héllo\nworld"})
    assert out["stdout"]["data"] == "héllo\nworld"
    raw = bytes(range(256)) * 1000
    out = ok(
        sandbox_server,
        agent.instance_id,
        {
            "argv": ["cat"],
            "stdin_base64": base64.b64encode(raw).decode(),
            "output_encoding": "base64",
        },
    )
    assert base64.b64decode(out["stdout"]["data"]) == raw
    # no stdin given: the command reads /dev/null, it does not wait
    out = ok(sandbox_server, agent.instance_id, {"argv": ["wc", "-c"]})
    assert out["stdout"]["data"].strip() == "0"


def test_a_signal_is_reported_instead_of_an_exit_code(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = ok(sandbox_server, agent.instance_id, {"argv": ["sh", "-c", "kill -TERM $$"]})
    assert out["exit_code"] is None and out["signal"] == "TERM" and out["reason"] is None


def test_output_kept_up_to_the_limit_is_marked_truncated(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    out = ok(
        sandbox_server,
        agent.instance_id,
        {"argv": ["seq", "1", "100000"], "stdout_limit_bytes": 10},
    )
    assert out["exit_code"] == 0 and out["reason"] is None
    assert out["stdout"]["data"] == "1\n2\n3\n4\n5\n"
    assert out["stdout"]["truncated"] and out["stdout"]["bytes"] == 588895


def test_the_streaming_form_delivers_chunks_then_the_exit(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    lines = list(
        stream_lines(
            sandbox_server,
            agent.instance_id,
            {"argv": ["sh", "-c", "echo first; echo oops >&2; sleep 0.2; echo second; exit 7"]},
        )
    )
    assert lines[0]["type"] == "started" and lines[0]["pid"] > 0
    assert lines[0]["budget"]["timeout_seconds"] == 600
    out = "".join(ln["data"] for ln in lines if ln["type"] == "stdout")
    err = "".join(ln["data"] for ln in lines if ln["type"] == "stderr")
    assert (out, err) == ("first\nsecond\n", "oops\n")
    assert lines[-1]["type"] == "exit" and lines[-1]["exit_code"] == 7
    assert lines[-1]["stdout"]["bytes"] == 13 and lines[-1]["exec_id"] == lines[0]["exec_id"]


def test_bad_input_is_named(sandbox_server: ServerProcess, agent: AgentProcess) -> None:
    iid = agent.instance_id
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({"argv": []}, 422, "body.argv", ""),
        ({"argv": [""]}, 422, "body.argv", ""),
        ({"argv": ["no-such-program-x1"]}, 422, "body.argv", "bad-argv"),
        ({"argv": ["ls"], "cwd": "/no/such/dir"}, 422, "body.cwd", "bad-cwd"),
        ({"argv": ["ls"], "cwd": "relative"}, 422, "body.cwd", ""),
        ({"argv": ["ls"], "user": "nosuchuserx1"}, 422, "body.user", "bad-user"),
        ({"argv": ["ls"], "stdin": "a", "stdin_base64": "YQ=="}, 422, "body", ""),
        ({"argv": ["cat"], "stdin_base64": "not base64!"}, 422, "body.stdin_base64", ""),
        ({"argv": ["ls"], "stdout_limit_bytes": 1 << 30}, 422, "body.stdout_limit_bytes", ""),
        (
            {"argv": ["ls"], "budget": {"timeout_seconds": 90000}},
            422,
            "body.budget.timeout_seconds",
            "",
        ),
        ({"argv": ["ls"], "budget": {"memory_mib": 0}}, 422, "body.budget.memory_mib", ""),
        ({"argv": ["ls"], "bogus": 1}, 422, "body.bogus", ""),
    ]
    for body, status, where, code in cases:
        got, problem = run(sandbox_server, iid, body)
        assert got == status, (body, got, problem)
        assert problem_field(problem) == where, (body, problem)
        assert where in problem["detail"], problem
        if code:
            assert problem["code"] == code
    # stdin over the limit: 413 naming the setting
    got, problem = run(sandbox_server, iid, {"argv": ["cat"], "stdin": "x" * (600 * 1024)})
    assert got == 413 and problem["code"] == "stdin-too-large"
    assert "SANDBOX_EXEC_MAX_STDIN_BYTES" in problem["detail"]
    assert problem_field(problem) == "body.stdin"
    # unknown instance
    got, problem = run(sandbox_server, "x1-nobody", {"argv": ["ls"]})
    assert got == 404


def test_the_command_starts_in_its_cgroup_as_given_and_non_programs_are_refused(
    sandbox_server: ServerProcess, agent: AgentProcess, tmp_path: Path
) -> None:
    """The agent holds the child until it is in the run's cgroup, then the child becomes the
    command: its first look at /proc/self/cgroup is the run's, its argv is the request's, and
    what execve would refuse is refused by name (never run as a shell script)."""
    iid = agent.instance_id
    out = ok(sandbox_server, iid, {"argv": ["cat", "/proc/self/cgroup"]})
    lines = out["stdout"]["data"].splitlines()
    if os.geteuid() == 0:
        for controller in ("pids", "memory", "freezer"):
            line = next(x for x in lines if x.split(":")[1] == controller)
            assert "/agentic-sandbox/" in line and line.endswith(tuple("0123456789")), line
    out = ok(sandbox_server, iid, {"argv": ["sh", "-c", "tr '\\0' ' ' </proc/$$/cmdline", "a b"]})
    assert out["stdout"]["data"] == "sh -c tr '\\0' ' ' </proc/$$/cmdline a b ", out
    script = tmp_path / "noshebang"
    script.write_text("touch ran-as-script\n")
    script.chmod(0o755)
    plain = tmp_path / "notexec"
    plain.write_text("#!/bin/sh\necho hi\n")
    plain.chmod(0o644)
    for argv0, why in ((str(script), "Exec format error"), (str(plain), "Permission denied")):
        got, problem = run(sandbox_server, iid, {"argv": [argv0], "cwd": str(tmp_path)})
        assert got == 422 and problem["code"] == "bad-argv", problem
        assert why in problem["detail"] and problem_field(problem) == "body.argv", problem
    assert not (tmp_path / "ran-as-script").exists()
    # a relative path is the cwd's, as for execve after the chdir
    good = tmp_path / "good"
    good.write_text('#!/bin/sh\necho good "$@"\n')
    good.chmod(0o755)
    out = ok(sandbox_server, iid, {"argv": ["./good", "x"], "cwd": str(tmp_path)})
    assert out["stdout"]["data"] == "good x\n" and out["exit_code"] == 0


def test_viewers_cannot_run_and_other_owners_see_nothing(
    sandbox_server: ServerProcess, agent: AgentProcess
) -> None:
    viewer = sandbox_server.make_token(f"v-{uuid.uuid4().hex[:6]}", "viewer")
    other = sandbox_server.make_token(f"o-{uuid.uuid4().hex[:6]}", "operator")
    body = {"argv": ["id"]}
    status, problem = run(sandbox_server, agent.instance_id, body, token=viewer)
    assert status == 403 and problem["code"] == "forbidden-role"
    status, problem = run(sandbox_server, agent.instance_id, body, token=other)
    assert status == 404 and problem["code"] == "instance-not-found"
    for stream in (False, True):
        path = f"/api/v2/admin/instances/{agent.instance_id}/exec" + ("/stream" if stream else "")
        status, _ = sandbox_server.api("POST", path, body, token=other)
        assert status == 404


def test_loadout_defaults_and_ceilings(
    sandbox_server: ServerProcess, agent_factory: AgentFactory
) -> None:
    budgets = {
        "defaults": {"memory_mib": 64, "timeout_seconds": 30},
        "maxima": {"memory_mib": 128, "pids": 100},
    }
    a = agent_factory(sandbox_server, unique_id("x1-ceil"), profile={"budgets": budgets})
    out = ok(sandbox_server, a.instance_id, {"argv": ["true"]})
    assert out["budget"] == {
        "timeout_seconds": 30.0,
        "memory_mib": 64,
        "cpus": None,
        "pids": 100,  # a ceiling without a default: runs at the ceiling
        "output_bytes": None,
    }
    out = ok(sandbox_server, a.instance_id, {"argv": ["true"], "budget": {"memory_mib": 32}})
    assert out["budget"]["memory_mib"] == 32  # lowered
    status, problem = run(
        sandbox_server, a.instance_id, {"argv": ["true"], "budget": {"memory_mib": 256}}
    )
    assert status == 422 and problem_field(problem) == "body.budget.memory_mib"
    assert "128" in problem["detail"]


def _start_sleeper(
    server: ServerProcess, instance_id: str, marker: str
) -> tuple[threading.Thread, list[dict[str, Any]], threading.Event]:
    """A streaming exec of a long sleep in a thread; its lines collect as they come."""
    lines: list[dict[str, Any]] = []
    started = threading.Event()

    def go() -> None:
        try:
            for line in stream_lines(
                server,
                instance_id,
                {"argv": ["sh", "-c", f"sleep 60 # {marker}"], "budget": {"timeout_seconds": 90}},
            ):
                lines.append(line)
                started.set()
        except Exception as exc:  # the test reads what arrived
            lines.append({"type": "client-error", "error": repr(exc)})
        started.set()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, lines, started


def test_concurrent_execs_per_instance_are_limited(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory(SANDBOX_EXEC_MAX_PER_INSTANCE="1")
    a = agent_factory(server, unique_id("x1-conc"))
    marker = f"x1-conc-{uuid.uuid4().hex[:8]}"
    thread, lines, started = _start_sleeper(server, a.instance_id, marker)
    assert started.wait(30) and lines[0]["type"] == "started", lines
    status, problem = run(server, a.instance_id, {"argv": ["true"]})
    assert status == 429 and problem["code"] == "too-many-execs"
    assert "SANDBOX_EXEC_MAX_PER_INSTANCE" in problem["detail"]
    # the agent's own limit of streams answers 429 as well
    a2 = agent_factory(server, unique_id("x1-conc"), extra_args=["--max-streams", "1"])
    thread2, lines2, started2 = _start_sleeper(server, a2.instance_id, marker)
    assert started2.wait(30) and lines2[0]["type"] == "started", lines2
    server2_status, problem2 = run(server, a2.instance_id, {"argv": ["true"]})
    assert server2_status == 429, problem2
    # stopping the agents ends their runs (the links go; nothing is left)
    a.stop()
    a2.stop()
    thread.join(30)
    thread2.join(30)
    assert lines[-1]["type"] in ("error", "client-error"), lines[-1]
    wait_until(lambda: not processes_with(marker), "the sleeps are gone")


def test_a_link_that_drops_mid_exec_ends_it_with_an_error(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory(
        SANDBOX_AGENT_HEARTBEAT_SECONDS="0.5", SANDBOX_AGENT_DISCONNECT_AFTER_HEARTBEATS="4"
    )
    a = agent_factory(server, unique_id("x1-drop"))
    assert a.proc is not None
    marker = f"x1-drop-{uuid.uuid4().hex[:8]}"
    thread, lines, started = _start_sleeper(server, a.instance_id, marker)
    assert started.wait(30) and lines[0]["type"] == "started", lines
    pid = lines[0]["pid"]
    os.kill(a.worker_pid(), signal.SIGSTOP)  # the agent goes silent; the server drops the link
    try:
        thread.join(60)
        assert not thread.is_alive()
        assert lines[-1]["type"] == "error" and lines[-1]["code"] == "agent-link-lost", lines
    finally:
        os.kill(a.worker_pid(), signal.SIGCONT)
    # back, the agent finds its link dead and ends the run it can no longer report
    assert_cleaned_up(marker, a.worker_pid())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    a.wait_connected()
    assert ok(server, a.instance_id, {"argv": ["echo", "again"]})["stdout"]["data"] == "again\n"
