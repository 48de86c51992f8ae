"""sandboxctl's verbs against a real server with a real host agent: audit filters, agent
cards (verified, and a tampered one refused), completion scripts, attach and task watch
without a terminal, and every verb with the global options before the noun and after the
verb (`FLEET_VERBS` in test_sandboxctl_fleet.py covers the verbs that need a fleet)."""

from __future__ import annotations

import argparse
import base64
import inspect
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentic_sandbox import Client
from agentic_sandbox.sandboxctl.main import build_parser
from tests.support.agents import AgentProcess
from tests.support.cli import Sandboxctl
from tests.support.fixtures import AgentFactory
from tests.support.server import ServerProcess, free_port
from tests.support.upgrades import repack


def all_verbs() -> set[str]:
    """Every `noun verb` (or lone noun) the parser knows."""

    def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    out = set()
    for noun, np in subparsers(build_parser()).items():
        verbs = subparsers(np)
        out |= {f"{noun} {v}" for v in verbs} if verbs else {noun}
    return out


@pytest.fixture
def ctl(sandbox_server: ServerProcess, tmp_path: Path) -> Sandboxctl:
    return Sandboxctl(sandbox_server.url, sandbox_server.admin_token, tmp_path / "cli")


@pytest.fixture
def sdk(sandbox_server: ServerProcess) -> Iterator[Client]:
    with Client(sandbox_server.url, sandbox_server.admin_token) as client:
        yield client


@pytest.fixture
def agent(sandbox_server: ServerProcess, agent_factory: AgentFactory) -> AgentProcess:
    return agent_factory(sandbox_server)


def finished_session(sdk: Client, instance_id: str, text: str) -> str:
    session = sdk.sessions.create(instance_id, ["bash", "-c", f"echo {text}"])
    deadline = time.monotonic() + 30
    while sdk.sessions.get(session.id).state == "running":
        assert time.monotonic() < deadline, "the session did not end"
        time.sleep(0.1)
    return session.id


def test_audit_list_filters(ctl: Sandboxctl, sdk: Client, agent: AgentProcess) -> None:
    viewer = sdk.tokens.create("audit-viewer", role="viewer").token
    assert ctl("secret", "set", "AUDIT_ONE", "x" * 8, token=viewer).returncode == 4  # denied
    assert ctl("secret", "set", "AUDIT_ONE", "x" * 8).returncode == 0
    denied = ctl.json("audit", "list", "--outcome", "denied", "--actor", "token:audit-viewer")
    assert denied["items"], denied
    assert {(e["actor"], e["outcome"]) for e in denied["items"]} == {
        ("token:audit-viewer", "denied")
    }
    mine = ctl.json(
        "audit", "list", "--subject-type", "instance", "--subject-id", agent.instance_id
    )
    assert mine["items"] and {e["subject_id"] for e in mine["items"]} == {agent.instance_id}
    # paging: --after the first entry's id leaves it out
    first = ctl.json("audit", "list", "--limit", "1")
    rest = ctl.json("audit", "list", "--after", str(first["next"]), "--limit", "1000")
    assert first["items"][0]["id"] not in {e["id"] for e in rest["items"]}
    table = ctl("audit", "list", "--subject-id", agent.instance_id)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:4] == [
        "ID",
        "TIME",
        "ACTOR",
        "ACTION",
    ], table.stdout
    res = ctl("audit", "list", "--outcome", "maybe")
    assert res.returncode == 2 and "--outcome" in res.stderr


def test_ls_lists_a_file_as_ls_does_with_readable_times(
    ctl: Sandboxctl, agent: AgentProcess, tmp_path: Path
) -> None:
    one = tmp_path / "ls-one.txt"
    one.write_text("12345")
    os.utime(one, (1_700_000_000, 1_700_000_000))
    when = "2023-11-14 22:13:20"  # 1_700_000_000 in UTC
    res = ctl("instance", "ls", agent.instance_id, str(one))
    assert res.returncode == 0, res.stderr
    header, row = res.stdout.splitlines()
    assert header.split() == ["NAME", "TYPE", "SIZE", "MODE", "OWNER", "GROUP", "MTIME"]
    assert row.split()[:3] == ["ls-one.txt", "file", "5"] and row.endswith(when), row
    listing = ctl("instance", "ls", agent.instance_id, str(tmp_path))
    (line,) = (x for x in listing.stdout.splitlines() if x.startswith("ls-one.txt "))
    assert line.endswith(when), listing.stdout
    assert ctl.json("instance", "ls", agent.instance_id, str(one))["mtime"] == 1_700_000_000
    missing = ctl("instance", "ls", agent.instance_id, str(tmp_path / "none"))
    assert missing.returncode != 0 and "does not exist" in missing.stderr


def test_agentcard_get_and_verify(ctl: Sandboxctl, agent: AgentProcess, tmp_path: Path) -> None:
    card = ctl.json("agentcard", "get", agent.instance_id)
    assert card["supportedInterfaces"][0]["url"].endswith(f"/agents/{agent.instance_id}")
    assert card["signatures"], card
    verified = ctl.json("agentcard", "verify", agent.instance_id)
    assert verified["verified"] is True and verified["instance"] == agent.instance_id
    kid = json.loads(base64.urlsafe_b64decode(card["signatures"][0]["protected"] + "=="))["kid"]
    assert verified["signed_by"]["kid"] == kid
    assert verified["signed_by"]["algorithm"] == "EdDSA"
    assert verified["signed_by"]["key"] == "OKP Ed25519"
    assert verified["signed_by"]["jwks"].endswith(
        f"/agents/{agent.instance_id}/.well-known/jwks.json"
    )
    table = ctl("agentcard", "verify", agent.instance_id)
    assert table.returncode == 0 and kid in table.stdout and "verified" in table.stdout
    # one changed word and the signature no longer holds
    tampered = {**card, "description": card["description"] + " (and then some)"}
    path = tmp_path / "card.json"
    path.write_text(json.dumps(tampered))
    res = ctl("agentcard", "verify", agent.instance_id, "--card", str(path))
    assert res.returncode == 1 and "does not verify" in res.stderr, (res.stdout, res.stderr)
    res = ctl("agentcard", "verify", "no-such-instance")
    assert res.returncode == 3, res.stderr


def test_completion_scripts_come_from_the_parser(ctl: Sandboxctl, tmp_path: Path) -> None:
    import shutil
    import subprocess

    bash = ctl("completion", "bash")
    assert bash.returncode == 0, bash.stderr
    # every noun and a new verb are in it, so it was generated from the real parser
    for word in ("instance", "agentcard", "operation", "revert", "snapshots"):
        assert word in bash.stdout, word
    script = tmp_path / "sandboxctl.bash"
    script.write_text(bash.stdout)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr  # valid bash
    # ask it, as bash does on TAB, what follows `sandboxctl pool `
    probe = subprocess.run(
        [
            "bash",
            "-c",
            f"source {script}; COMP_WORDS=(sandboxctl pool ''); COMP_CWORD=2; "
            "COMP_LINE='sandboxctl pool '; COMP_POINT=${#COMP_LINE}; "
            "_shtab_sandboxctl; printf '%s\\n' \"${COMPREPLY[@]}\"",
        ],
        capture_output=True,
        text=True,
    )
    assert set(probe.stdout.split()) >= {"create", "list", "delete"}, (probe.stdout, probe.stderr)
    zsh = ctl("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef sandboxctl"), zsh.stdout[:80]
    if shutil.which("zsh"):
        script = tmp_path / "_sandboxctl"
        script.write_text(zsh.stdout)
        check = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_attach_and_watch_without_a_terminal(
    ctl: Sandboxctl, sdk: Client, agent: AgentProcess
) -> None:
    sid = finished_session(sdk, agent.instance_id, "printed-$((6*7))")
    res = ctl("session", "attach", sid)
    assert res.returncode == 0, res.stderr
    assert "printed-42" in res.stdout and "exited with 0" in res.stderr
    task = sdk.tasks.send(agent.instance_id, "echo watched-$((7*6)); exit 3")
    watch = ctl("task", "watch", task.id)
    assert watch.returncode == 0, watch.stderr
    assert "watched-42" in watch.stdout
    assert json.loads(watch.stdout.splitlines()[-1]) == {"state": "failed", "exit_code": 3}


# ---- every verb, with the global options before the noun and after the verb ---------------------
Args = Callable[[], list[str] | Awaitable[list[str]]]


@dataclass
class Case:
    verb: str
    args: Args  # made fresh for each run (a kill needs its own session)
    json_out: bool = True
    check: Callable[[str], bool] | None = None  # for text output
    code: int = 0
    # a `sandboxctl` process per run; else main() in this process, the same argv and
    # environment (a process start is ~1 s; each list keeps a verb or two as processes)
    process: bool = False


async def run_both_ways(ctl: Sandboxctl, url: str, case: Case) -> None:
    """$SANDBOX_URL points at a dead port: only a --server that the verb honours reaches
    the server; -o json must give JSON (or the verb's own text) in both positions."""
    run = ctl.run_async if case.process else ctl.run_inprocess_async
    opts = ["--server", url, "-o", "json"]
    words = case.verb.split()
    shapes = []
    for before in (True, False):
        args = case.args()
        args = await args if inspect.isawaitable(args) else args
        argv = [*opts, *words, *args] if before else [*words, *args, *opts]
        code, out, err = await run(*argv)
        assert code == case.code, (argv, out, err)
        if case.json_out:
            lines = out.splitlines() if case.verb == "event tail" else [out]
            docs = [json.loads(line) for line in lines]  # one JSON document a line
            shapes.append(sorted({k for d in docs for k in d}))
        elif case.check is not None:
            assert case.check(out), (argv, out, err)
    if case.json_out:
        assert shapes[0] == shapes[1], (case.verb, shapes)


def non_fleet_cases(sdk: Client, agent: AgentProcess, tmp_path: Path) -> list[Case]:
    iid = agent.instance_id
    names = iter(range(1_000_000))

    def running_session() -> list[str]:
        return [sdk.sessions.create(iid, ["sleep", "60"]).id]

    def running_task() -> list[str]:
        return [sdk.tasks.send(iid, "sleep 60").id]

    def fresh_token() -> list[str]:
        return [sdk.tokens.create(f"pos-{next(names)}").id]

    def fresh_secret() -> list[str]:
        name = f"POS_{next(names)}"
        sdk.secrets.set(name, "v" * 8)
        return [name]

    ended = finished_session(sdk, iid, "position-test")
    pushed = tmp_path / "push-source.txt"
    pushed.write_text("pushed through the agent link\n")
    done_task = sdk.tasks.send(iid, "echo done")
    sdk.tasks.wait(done_task.id, timeout=60)
    bundle = tmp_path / "agent-bundle.tar.gz"
    bundle.write_bytes(repack("0.0.1+cli"))
    return [
        Case("whoami", lambda: [], process=True),
        Case("config get-contexts", lambda: []),
        Case("completion bash", lambda: [], False, lambda out: "_shtab_sandboxctl" in out),
        Case("completion zsh", lambda: [], False, lambda out: "#compdef sandboxctl" in out),
        Case("instance list", lambda: []),
        Case("instance get", lambda: [iid]),
        Case("instance egress", lambda: [iid]),
        Case(
            "instance egress",
            lambda: [iid, "--allow", "api.example.com:443", "--allow", "*.pypi.org:443"],
        ),
        Case(
            "instance egress",
            lambda: [iid, "--allow", "*x.example:443"],
            False,
            lambda out: out == "",
            code=6,
        ),
        # (no `--`: the options after it would be the command's own; -o json: the answer)
        Case(
            "instance exec",
            lambda: [iid, "echo", "exec-ok"],
            False,
            lambda out: json.loads(out)["stdout"]["data"] == "exec-ok\n",
            process=True,
        ),
        # (port 1: nothing listens there, so the verb says so at once and ends)
        Case("instance port-forward", lambda: [iid, "1"], False, lambda out: out == "", code=1),
        Case("instance push", lambda: [iid, str(pushed), str(tmp_path / f"pushed-{next(names)}")]),
        Case("instance pull", lambda: [iid, str(pushed), str(tmp_path / f"pulled-{next(names)}")]),
        Case("instance ls", lambda: [iid, str(tmp_path)]),
        Case("session list", lambda: ["--instance", iid]),
        Case("session new", lambda: [iid]),
        Case("session screen", lambda: [ended]),
        Case("session kill", running_session, False, lambda out: out.startswith("killed ")),
        Case(
            "session record",
            lambda: [ended, str(tmp_path / f"rec-{next(names)}.cast")],
            False,
            lambda out: "asciicast" in out,
        ),
        Case("session attach", lambda: [ended], False, lambda out: "position-test" in out),
        Case("task send", lambda: [iid, "echo sent"]),
        Case("task list", lambda: ["--instance", iid]),
        Case("task get", lambda: [done_task.id]),
        Case("task cancel", running_task),
        Case("task watch", lambda: [done_task.id], False, lambda out: "done" in out),
        Case("token create", lambda: ["--subject", f"pos-new-{next(names)}"]),
        Case("token list", lambda: []),
        Case("token revoke", fresh_token, False, lambda out: out.startswith("revoked ")),
        Case("secret set", lambda: [f"POS_SET_{next(names)}", "v" * 8]),
        Case("secret list", lambda: []),
        Case("secret delete", fresh_secret, False, lambda out: out.startswith("deleted ")),
        Case("event tail", lambda: ["--limit", "3"]),
        Case("audit list", lambda: ["--limit", "3"]),
        Case("agentcard get", lambda: [iid]),
        Case("agentcard verify", lambda: [iid]),
        Case("operation list", lambda: []),
        Case("agent list", lambda: []),
        Case("agent bundles", lambda: []),
        Case("agent upload-bundle", lambda: [str(bundle)]),
        # the server's own bundle: the first run upgrades the agent, the second skips it
        Case(
            "agent rollout",
            lambda: ["--instance", iid, "--trial-seconds", "60"],
            False,
            lambda out: "agent-rollout" in out and "succeeded" in out,
        ),
    ]


NON_FLEET_VERBS = {
    "whoami",
    "config get-contexts",
    "completion bash",
    "completion zsh",
    "instance list",
    "instance get",
    "instance egress",
    "instance exec",
    "instance port-forward",
    "instance push",
    "instance pull",
    "instance ls",
    "session list",
    "session new",
    "session screen",
    "session kill",
    "session record",
    "session attach",
    "task send",
    "task list",
    "task get",
    "task cancel",
    "task watch",
    "token create",
    "token list",
    "token revoke",
    "secret set",
    "secret list",
    "secret delete",
    "event tail",
    "audit list",
    "agentcard get",
    "agentcard verify",
    "operation list",
    "agent list",
    "agent bundles",
    "agent upload-bundle",
    "agent rollout",
}


async def test_global_options_work_in_any_position(
    sandbox_server: ServerProcess, sdk: Client, agent: AgentProcess, tmp_path: Path
) -> None:
    ctl = Sandboxctl(f"http://127.0.0.1:{free_port()}", sandbox_server.admin_token, tmp_path)
    cases = non_fleet_cases(sdk, agent, tmp_path)
    assert {c.verb for c in cases} == NON_FLEET_VERBS
    for case in cases:
        await run_both_ways(ctl, sandbox_server.url, case)
