"""The egress proxy end to end on the host: a real server, a real host agent with its egress
listener (what an `allowlist` guest's tools use), `curl` as the tool, and destinations in
network namespaces this test makes (their names only in the proxy's hosts file, the rules
naming their private addresses explicitly).

- an allowed name answers over plain HTTP and over HTTPS (`CONNECT`, the test's own CA);
- a name no rule allows, and an allowed name that resolves to an address no rule names
  (rebinding), are refused with their reasons, as events, audit rows and metrics;
- a rule change through the admin API applies to the next connection;
- the connection limit refuses with a reason while a tunnel holds the one slot.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.exec.helpers import processes_with, stream_lines
from tests.support.agents import AgentProcess, start_agent
from tests.support.cli import Sandboxctl
from tests.support.fixtures import unique_id
from tests.support.netns import NamespaceHost, available, make_cert
from tests.support.server import ServerProcess, free_port

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not available(), reason="needs root and ip netns"),
]

ALLOWED = "allowed.egress.test"
DENIED = "denied.egress.test"
REBOUND = "rebound.egress.test"  # allowed by name, resolves to the denied host's address


class Stack:
    def __init__(
        self,
        server: ServerProcess,
        agent: AgentProcess,
        proxy_port: int,
        allowed: NamespaceHost,
        denied: NamespaceHost,
        ca: Path,
    ) -> None:
        self.server = server
        self.agent = agent
        self.proxy = f"http://127.0.0.1:{proxy_port}"
        self.proxy_port = proxy_port
        self.allowed = allowed
        self.denied = denied
        self.ca = ca
        self.instance = agent.instance_id

    def put(self, allow: list[str], **limits: int) -> dict[str, Any]:
        body: dict[str, Any] = {"network": "allowlist", "allow": allow}
        if limits:
            body["limits"] = limits
        out: dict[str, Any] = self.server.ok(
            "PUT", f"/api/v2/admin/instances/{self.instance}/egress", body
        )
        return out

    def base_rules(self) -> list[str]:
        a = self.allowed.address
        return [f"{ALLOWED}:8080", f"{ALLOWED}:8443", f"{a}:8080", f"{a}:8443", f"{REBOUND}:8080"]

    def curl(self, url: str, *extra: str) -> tuple[int, str, str]:
        """(exit status, body, `http_code connect_code`) of curl through the agent's listener."""
        proc = subprocess.run(
            [
                "curl",
                "-sS",
                "--max-time",
                "20",
                "--proxy",
                self.proxy,
                "--cacert",
                str(self.ca),
                "-w",
                "\n%{http_code} %{http_connect}",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        body, _, codes = proc.stdout.rpartition("\n")
        return proc.returncode, body.removesuffix("\n"), codes

    def events(self, after: int = 0) -> list[dict[str, Any]]:
        out = self.server.ok(
            "GET",
            f"/api/v1/events?type=egress.*&instance_id={self.instance}&after={after}&limit=200",
        )
        items: list[dict[str, Any]] = out["items"]
        return items

    def wait_events(self, n: int, after: int = 0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 15
        while True:
            found = [e for e in self.events(after) if e["type"] != "egress.rules.changed"]
            if len(found) >= n or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def last_seq(self) -> int:
        items = self.events()
        return int(items[-1]["seq"]) if items else 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("egress")
    ca, cert, key = make_cert(tmp, ALLOWED)
    with NamespaceHost("allowed") as allowed, NamespaceHost("denied") as denied:
        allowed.serve_http(8080, "hello from the allowed host")
        allowed.serve_https(8443, cert, key, "tls hello from the allowed host")
        denied.serve_http(8080, "the denied host answered")
        hosts = tmp / "hosts"
        hosts.write_text(
            f"{allowed.address} {ALLOWED}\n{denied.address} {DENIED}\n{denied.address} {REBOUND}\n"
        )
        server = ServerProcess(
            tmp / "server",
            env={
                "SANDBOX_EGRESS_HOSTS_FILE": str(hosts),
                "SANDBOX_AGENT_HEARTBEAT_SECONDS": "0.5",
                "SANDBOX_RATE_LIMIT_PER_MINUTE": "100000",
                "SANDBOX_RATE_LIMIT_BURST": "10000",
            },
        ).start()
        port = free_port()
        agent = start_agent(
            server, unique_id("egress"), tmp, extra_args=["--egress-listen", f"127.0.0.1:{port}"]
        )
        try:
            yield Stack(server, agent, port, allowed, denied, ca)
        finally:
            agent.stop()
            server.stop()


def test_allowed_name_answers_over_http_and_https(stack: Stack) -> None:
    stack.put(stack.base_rules())
    after = stack.last_seq()
    status, body, codes = stack.curl(f"http://{ALLOWED}:8080/")
    assert (status, body, codes) == (0, "hello from the allowed host", "200 000")
    status, body, codes = stack.curl(f"https://{ALLOWED}:8443/x")
    assert (status, body, codes) == (0, "tls hello from the allowed host /x", "200 200")
    events = stack.wait_events(2, after)
    assert [e["type"] for e in events] == ["egress.allowed", "egress.allowed"]
    http, tls = (e["data"] for e in events)
    assert (http["kind"], http["method"], http["host"], http["address"], http["port"]) == (
        "http",
        "GET",
        ALLOWED,
        stack.allowed.address,
        8080,
    )
    assert (tls["kind"], tls["host"], tls["address"], tls["status"]) == (
        "connect",
        ALLOWED,
        stack.allowed.address,
        200,
    )
    assert tls["bytes_up"] > 200 and tls["bytes_down"] > 500  # a TLS handshake each way
    assert tls["duration_ms"] > 0 and tls["incarnation"]


def test_denied_and_rebound_names_are_refused_and_recorded(stack: Stack) -> None:
    stack.put(stack.base_rules())
    after = stack.last_seq()
    status, body, codes = stack.curl(f"http://{DENIED}:8080/")
    assert codes.startswith("403") and "not-allowed" in body
    status, _, codes = stack.curl(f"https://{DENIED}:8080/")
    assert status != 0 and codes.endswith("403")  # the CONNECT was refused
    status, body, codes = stack.curl(f"http://{REBOUND}:8080/")
    assert codes.startswith("403") and "address-private" in body
    assert "the denied host answered" not in body
    _, body, codes = stack.curl("http://169.254.169.254/latest/meta-data/")
    assert codes.startswith("403")
    events = stack.wait_events(4, after)
    assert [(e["type"], e["data"]["reason"]) for e in events] == [
        ("egress.denied", "not-allowed"),
        ("egress.denied", "not-allowed"),
        ("egress.denied", "address-private"),
        ("egress.denied", "not-allowed"),
    ]
    assert events[2]["data"]["address"] == stack.denied.address  # what it resolved to
    audit = stack.server.ok(
        "GET", f"/api/v2/admin/audit?subject_id={stack.instance}&outcome=denied&limit=1000"
    )["items"]
    connects = [a for a in audit if a["action"] == "egress.connect"]
    assert {a["detail"]["host"] for a in connects} >= {DENIED, REBOUND, "169.254.169.254"}
    metrics = stack.server.api("GET", "/metrics")[1]
    text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
    assert 'sandbox_egress_connections_total{reason="address-private",verdict="denied"}' in text
    assert 'sandbox_egress_bytes_total{direction="down"}' in text


def test_a_rule_change_applies_to_the_next_connection(stack: Stack) -> None:
    stack.put(stack.base_rules())
    assert stack.curl(f"http://{ALLOWED}:8080/")[2].startswith("200")
    got = stack.put([f"{ALLOWED}:8443", f"{stack.allowed.address}:8443"])
    assert [r["host"] for r in got["allow"]] == [ALLOWED, stack.allowed.address]
    assert stack.curl(f"http://{ALLOWED}:8080/")[2].startswith("403")
    assert stack.curl(f"https://{ALLOWED}:8443/")[2] == "200 200"
    read = stack.server.ok("GET", f"/api/v2/admin/instances/{stack.instance}/egress")
    assert read["network"] == "allowlist" and len(read["allow"]) == 2
    stack.put([])  # nothing allowed any more
    assert stack.curl(f"https://{ALLOWED}:8443/")[2].endswith("403")


def test_bad_rules_are_refused_naming_the_field(stack: Stack) -> None:
    status, out = stack.server.api(
        "PUT",
        f"/api/v2/admin/instances/{stack.instance}/egress",
        {"allow": ["ok.example:443", "*x.example:443"]},
    )
    assert status == 422
    assert "body.allow.1" in str(out) and "wildcard" in str(out)


def test_the_connection_limit_refuses_with_a_reason(stack: Stack) -> None:
    stack.put(stack.base_rules(), max_connections=1)
    held = socket.create_connection(("127.0.0.1", stack.proxy_port), timeout=10)
    try:
        held.sendall(f"CONNECT {ALLOWED}:8443 HTTP/1.1\r\nHost: {ALLOWED}:8443\r\n\r\n".encode())
        assert held.recv(100).startswith(b"HTTP/1.1 200")
        _, body, codes = stack.curl(f"http://{ALLOWED}:8080/")
        assert codes.startswith("429") and "connection-limit" in body
    finally:
        held.close()
    deadline = time.monotonic() + 15
    while not stack.curl(f"http://{ALLOWED}:8080/")[2].startswith("200"):
        assert time.monotonic() < deadline, "the slot never came back"
        time.sleep(0.1)
    stack.put(stack.base_rules(), max_connections=32)


def test_the_agents_commands_get_the_proxy_settings(stack: Stack) -> None:
    """An exec (no login shell) has the proxy variables, so a plain `curl` goes through it."""
    stack.put(stack.base_rules())
    out = stack.server.ok(
        "POST",
        f"/api/v2/admin/instances/{stack.instance}/exec",
        {
            "argv": [
                "sh",
                "-c",
                "echo $http_proxy $HTTPS_PROXY; curl -sS http://" + ALLOWED + ":8080/",
            ]
        },
    )
    assert out["exit_code"] == 0, out
    first, body = out["stdout"]["data"].splitlines()
    plain, tokened = first.split()
    assert plain == tokened and body == "hello from the allowed host", out
    # the exec's own URL: the proxy's address with the exec's token as its userinfo
    assert re.fullmatch(rf"http://run:[0-9a-f]{{32}}@127\.0\.0\.1:{stack.proxy_port}", plain)


def exec_connections(stack: Stack, exec_id: str) -> list[dict[str, Any]]:
    """The audit rows of the proxy connections counted to exec `exec_id`."""
    rows = stack.server.ok("GET", f"/api/v2/admin/audit?subject_id={stack.instance}&limit=1000")[
        "items"
    ]
    return [
        r["detail"]
        for r in rows
        if r["action"] == "egress.connect" and r["detail"].get("exec_id") == exec_id
    ]


def test_an_exec_reports_its_egress_bytes(stack: Stack) -> None:
    """An exec that fetches over plain HTTP and HTTPS through the proxy: its answer's usage
    is the sum of the bytes of its connections' audit rows (which name it), and so is the
    streamed exit line and the instance.exec.finished event."""
    stack.put(stack.base_rules())
    script = (
        f"curl -sS http://{ALLOWED}:8080/ && curl -sS --cacert {stack.ca} https://{ALLOWED}:8443/y"
    )
    out = stack.server.ok(
        "POST", f"/api/v2/admin/instances/{stack.instance}/exec", {"argv": ["sh", "-c", script]}
    )
    assert out["exit_code"] == 0 and out["stdout"]["data"] == (
        "hello from the allowed host\ntls hello from the allowed host /y\n"
    ), out
    rows = exec_connections(stack, out["exec_id"])
    assert sorted(r["kind"] for r in rows) == ["connect", "http"], rows
    usage = out["usage"]
    assert usage["network_egress_bytes"] == sum(r["bytes_up"] for r in rows) > 0, (usage, rows)
    assert usage["network_ingress_bytes"] == sum(r["bytes_down"] for r in rows) > 500
    assert all("run_id" not in r for r in rows)  # an exec's, not a task run's

    # Python's urllib (what the guest image has): it sends the token too (it is a password)
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://{ALLOWED}:8080/').read())"
    lines = list(
        stream_lines(stack.server, stack.instance, {"argv": [sys.executable, "-c", fetch]})
    )
    exit_line = lines[-1]
    assert exit_line["type"] == "exit" and exit_line["exit_code"] == 0, lines
    (row,) = exec_connections(stack, exit_line["exec_id"])
    assert (
        exit_line["usage"]["network_egress_bytes"],
        exit_line["usage"]["network_ingress_bytes"],
    ) == (row["bytes_up"], row["bytes_down"])
    finished = stack.server.ok(
        "GET", f"/api/v1/events?type=instance.exec.finished&instance_id={stack.instance}&limit=200"
    )["items"]
    (event,) = [e for e in finished if e["data"]["exec_id"] == exit_line["exec_id"]]
    assert event["data"]["usage"]["network_egress_bytes"] == row["bytes_up"]


def test_an_exec_without_connections_counts_none_of_the_others(stack: Stack) -> None:
    """An exec that connects to nothing reports 0 while connections from elsewhere on the guest
    (no token, and an unknown token — allowed all the same: the token is no permission) are
    made during it; another instance's exec token is not this instance's either."""
    stack.put(stack.base_rules())
    result: dict[str, Any] = {}
    marker = f"egress-idle-{unique_id('x')}"
    body = {"argv": ["sh", "-c", f"echo {marker}; sleep 3"]}
    worker = threading.Thread(
        target=lambda: result.update(
            stack.server.ok("POST", f"/api/v2/admin/instances/{stack.instance}/exec", body)
        )
    )
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while not processes_with(marker):
            assert time.monotonic() < deadline, "the exec never started"
            time.sleep(0.05)
        after = stack.last_seq()
        assert stack.curl(f"http://{ALLOWED}:8080/")[2].startswith("200")
        unknown = f"http://run:{'0' * 32}@127.0.0.1:{stack.proxy_port}"
        proc = subprocess.run(
            ["curl", "-sS", "--max-time", "20", "--proxy", unknown, f"http://{ALLOWED}:8080/"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.stdout == "hello from the allowed host\n", proc
        events = stack.wait_events(2, after)
        assert [e["type"] for e in events] == ["egress.allowed", "egress.allowed"], events
        assert all("exec_id" not in e["data"] for e in events), events
        assert processes_with(marker), "the exec ended before the other connections did"
    finally:
        worker.join(timeout=60)
    assert result["exit_code"] == 0, result
    assert (
        result["usage"]["network_egress_bytes"],
        result["usage"]["network_ingress_bytes"],
    ) == (0, 0), result


def test_a_task_run_reports_its_egress_bytes(stack: Stack) -> None:
    """A task whose command fetches through the proxy: its connection is attributed to the
    run (audit row and event name the task), and the run's usage reports the bytes."""
    stack.put(stack.base_rules())
    after = stack.last_seq()
    # the run sleeps first: connections are attributed to the run the server sees running
    script = "sleep 1.5; curl -sS http://" + ALLOWED + ":8080/"
    task = stack.server.ok(
        "POST", "/api/v1/tasks", {"instance_id": stack.instance, "command": script}
    )
    deadline = time.monotonic() + 60
    while task["state"] not in ("completed", "failed", "rejected", "canceled"):
        assert time.monotonic() < deadline, task
        time.sleep(0.1)
        task = stack.server.ok("GET", f"/api/v1/tasks/{task['id']}")
    assert task["state"] == "completed", task
    (event,) = stack.wait_events(1, after)
    assert event["type"] == "egress.allowed" and event["task_id"] == task["id"], event
    data = event["data"]
    deadline = time.monotonic() + 15
    while not (
        done := stack.server.ok("GET", f"/api/v1/events?type=task.completed&task_id={task['id']}")[
            "items"
        ]
    ):
        assert time.monotonic() < deadline, "no task.completed event"
        time.sleep(0.1)
    usage = done[-1]["data"]["usage"]
    assert (usage["network_egress_bytes"], usage["network_ingress_bytes"]) == (
        data["bytes_up"],
        data["bytes_down"],
    ), (usage, data)
    assert usage["network_egress_bytes"] > 0 and usage["network_ingress_bytes"] > 0


def test_sandboxctl_exec_json_shows_the_egress_bytes(stack: Stack, tmp_path: Path) -> None:
    """`sandboxctl instance exec -o json` prints the whole answer, its usage with the egress
    bytes of the exec's one connection, and exits with the command's status."""
    stack.put(stack.base_rules())
    ctl = Sandboxctl(stack.server.url, stack.server.admin_token, tmp_path / "cli")
    args = ("instance", "exec", stack.instance, "-o", "json", "--")
    res = ctl(*args, "curl", "-sS", f"http://{ALLOWED}:8080/")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["stdout"]["data"] == "hello from the allowed host\n", out
    (row,) = exec_connections(stack, out["exec_id"])
    assert (out["usage"]["network_egress_bytes"], out["usage"]["network_ingress_bytes"]) == (
        row["bytes_up"],
        row["bytes_down"],
    ) and row["bytes_down"] > 0
    res = ctl(*args, "sh", "-c", "exit 3")
    assert res.returncode == 3 and json.loads(res.stdout)["exit_code"] == 3, res
    assert json.loads(res.stdout)["usage"]["network_egress_bytes"] == 0
