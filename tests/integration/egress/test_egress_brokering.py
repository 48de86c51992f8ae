"""Brokered credentials end to end on the host: a real server, a real host agent (its egress
listener, and `--egress-ca-file` where the server's `egress_trust` stream puts the
incarnation's CA), `curl` as the tool, and HTTPS hosts in a network namespace this test makes
(names only in the proxy's hosts file; the upstream's test CA through
`SANDBOX_EGRESS_UPSTREAM_CA_FILE`).

- the CA reaches the agent at its registration (`egress.ca.installed`), and a new one, whose
  name constraint permits the new destinations, when the brokered destinations change;
- a brokered request reaches the namespace host, which checks the header (the guest sent
  none, or a wrong one: replaced);
- a destination without a credential is a plain tunnel: the client sees the real certificate;
- an upstream whose certificate does not verify is refused with the reason;
- the secret's value is in no API answer, event, audit row or log.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.support.agents import AgentProcess, start_agent
from tests.support.fixtures import unique_id
from tests.support.netns import NamespaceHost, available, make_cert
from tests.support.server import ServerProcess, free_port

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not available(), reason="needs root and ip netns"),
]

API = "api.brokered.test"  # brokered on 8443 (verifies) and 8445 (a CA the proxy does not trust)
VALUE = "sbx-brokered-7d1f0c9e4b2a"
SECRET = "BROKER_TOKEN"


class Stack:
    def __init__(
        self,
        server: ServerProcess,
        agent: AgentProcess,
        port: int,
        host: NamespaceHost,
        test_ca: Path,
        agent_ca: Path,
    ) -> None:
        self.server = server
        self.agent = agent
        self.proxy = f"http://127.0.0.1:{port}"
        self.host = host
        self.test_ca = test_ca
        self.agent_ca = agent_ca
        self.instance = agent.instance_id
        self.path = f"/api/v2/admin/instances/{self.instance}/egress"

    def put(self, credentials: list[dict[str, Any]] | None) -> tuple[int, Any]:
        a = self.host.address
        body: dict[str, Any] = {
            "network": "allowlist",
            "allow": [f"{API}:{p}" for p in (8443, 8444, 8445)]
            + [f"{a}:{p}" for p in (8443, 8444, 8445)],
        }
        if credentials is not None:
            body["credentials"] = credentials
        return self.server.api("PUT", self.path, body)

    def curl(self, url: str, cacert: Path) -> tuple[int, str, str]:
        proc = subprocess.run(
            [
                "curl",
                "-sS",
                "--max-time",
                "20",
                "--proxy",
                self.proxy,
                "--cacert",
                str(cacert),
                "-w",
                "\n%{http_code} %{http_connect}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        body, _, codes = proc.stdout.rpartition("\n")
        return proc.returncode, body.removesuffix("\n") + proc.stderr, codes

    def events(self, kind: str = "egress.*") -> list[dict[str, Any]]:
        out = self.server.ok(
            "GET", f"/api/v1/events?type={kind}&instance_id={self.instance}&limit=200"
        )
        return list(out["items"])


def wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("brokering")
    (tmp / "good").mkdir()
    (tmp / "other").mkdir()
    test_ca, cert, key = make_cert(tmp / "good", API)
    _, bad_cert, bad_key = make_cert(tmp / "other", API)  # signed by a CA nobody trusts
    with NamespaceHost("brokered") as host:
        need = ("Authorization", f"Bearer {VALUE}")
        host.serve_https(8443, cert, key, "brokered host", require=need)
        host.serve_https(8444, cert, key, "plain host", require=need)
        host.serve_https(8445, bad_cert, bad_key, "bad cert host", require=need)
        hosts = tmp / "hosts"
        hosts.write_text(f"{host.address} {API}\n")
        server = ServerProcess(
            tmp / "server",
            env={
                "SANDBOX_EGRESS_HOSTS_FILE": str(hosts),
                "SANDBOX_EGRESS_UPSTREAM_CA_FILE": str(test_ca),
                "SANDBOX_RATE_LIMIT_PER_MINUTE": "100000",
                "SANDBOX_RATE_LIMIT_BURST": "10000",
            },
        ).start()
        port = free_port()
        agent_ca = tmp / "agent-trust" / "egress.crt"
        agent = start_agent(
            server,
            unique_id("broker"),
            tmp,
            extra_args=["--egress-listen", f"127.0.0.1:{port}", "--egress-ca-file", str(agent_ca)],
        )
        try:
            yield Stack(server, agent, port, host, test_ca, agent_ca)
        finally:
            agent.stop()
            server.stop()


def test_the_ca_reaches_the_agent_when_it_registers(stack: Stack) -> None:
    installed = wait_for(lambda: stack.events("egress.ca.installed"), "egress.ca.installed")
    data = installed[-1]["data"]
    assert data["path"] == str(stack.agent_ca) and data["refreshed"] is False
    assert len(data["fingerprint"]) == 64
    pem = stack.agent_ca.read_text()
    assert pem.startswith("-----BEGIN CERTIFICATE-----") and "PRIVATE" not in pem


def test_a_brokered_request_carries_the_header_and_nothing_else_is_intercepted(
    stack: Stack,
) -> None:
    wait_for(lambda: stack.agent_ca.exists(), "the CA file")
    first = wait_for(lambda: stack.events("egress.ca.installed"), "egress.ca.installed")
    before = {e["data"]["fingerprint"] for e in first}
    status, out = stack.server.api("PUT", f"/api/v2/admin/secrets/{SECRET}", {"value": VALUE})
    assert status in (200, 201), out
    status, out = stack.put([{"secret": SECRET, "destinations": [f"{API}:8443", f"{API}:8445"]}])
    assert status == 200, out
    # new brokered destinations: a new CA whose name constraint permits them, sent at once
    (new,) = wait_for(
        lambda: [
            e for e in stack.events("egress.ca.installed") if e["data"]["fingerprint"] not in before
        ],
        "the new CA installed",
    )
    pem = stack.agent_ca.read_bytes()
    ca = x509.load_pem_x509_certificate(pem)
    assert hashlib.sha256(ca.public_bytes(Encoding.DER)).hexdigest() == new["data"]["fingerprint"]
    permitted = ca.extensions.get_extension_for_class(x509.NameConstraints).value
    assert permitted.permitted_subtrees is not None
    assert API in {n.value for n in permitted.permitted_subtrees}
    assert out["credentials"] == [
        {
            "secret": SECRET,
            "destinations": [f"{API}:8443", f"{API}:8445"],
            "header": "Authorization",
            "format": "Bearer {value}",
        }
    ]
    # brokered: the proxy shows a leaf of the incarnation's CA and sets the header
    code, body, codes = stack.curl(f"https://{API}:8443/brokered", stack.agent_ca)
    assert (code, body, codes) == (0, "credential ok", "200 200")
    # not brokered (another port of the same host): a plain tunnel, the real certificate
    code, body, codes = stack.curl(f"https://{API}:8444/brokered", stack.test_ca)
    assert (code, body, codes) == (0, "credential wrong: 0", "401 200")
    code, body, _ = stack.curl(f"https://{API}:8444/", stack.agent_ca)
    assert code == 60, body  # curl: the peer's certificate does not verify (not ours)
    # brokered, but the real upstream's certificate does not verify: refused with the reason
    code, body, codes = stack.curl(f"https://{API}:8445/brokered", stack.agent_ca)
    assert code != 0 and codes.endswith("502"), (code, body, codes)

    def brokered() -> list[dict[str, Any]] | None:
        found = [e for e in stack.events() if e["data"].get("port") in (8443, 8445)]
        return found if len(found) >= 2 else None

    ok, bad = wait_for(brokered, "the brokered attempts' events")[-2:]
    assert (ok["type"], ok["data"]["credential"], ok["data"]["status"]) == (
        "egress.allowed",
        SECRET,
        200,
    )
    assert (bad["type"], bad["data"]["reason"]) == ("egress.failed", "upstream-certificate")
    assert "credential" not in bad["data"]


def test_bad_credentials_are_refused_naming_the_field(stack: Stack) -> None:
    status, out = stack.put([{"secret": "NO_SUCH_SECRET", "destinations": [f"{API}:8443"]}])
    assert status == 422 and "body.credentials.0.secret" in str(out), out
    status, out = stack.put([{"secret": SECRET, "destinations": ["*.brokered.test:443"]}])
    assert status == 422 and "body.credentials.0.destinations" in str(out), out
    status, out = stack.put([{"secret": SECRET, "destinations": [API + ":1"], "header": "Host"}])
    assert status == 422 and "body.credentials.0.header" in str(out), out
    # a PUT that does not name credentials keeps them (callers that know only `allow`)
    status, out = stack.put(None)
    assert status == 200 and [c["secret"] for c in out["credentials"]] == [SECRET]


def test_the_value_is_in_no_answer_event_audit_row_or_log(stack: Stack) -> None:
    assert stack.curl(f"https://{API}:8443/brokered", stack.agent_ca)[1] == "credential ok"
    answers = [
        stack.server.api("GET", stack.path)[1],
        stack.server.api("GET", "/api/v2/admin/secrets")[1],
        stack.server.api("GET", f"/api/v2/admin/instances/{stack.instance}")[1],
        stack.server.api("GET", "/api/v1/events?limit=200")[1],
        stack.server.api("GET", "/api/v2/admin/audit?limit=1000")[1],
    ]
    audit = answers[-1]["items"]
    assert any(a["action"] == "egress.rules" for a in audit)
    for answer in answers:
        assert VALUE not in str(answer)
    assert VALUE not in stack.server.log_path.read_text(errors="replace")
    assert VALUE not in stack.agent_ca.read_text()


def test_the_sdk_reads_and_replaces_credentials(stack: Stack) -> None:
    from agentic_sandbox import Client
    from agentic_sandbox.sdk import EgressCredential, ValidationFailed

    with Client(stack.server.url, stack.server.admin_token) as sbx:
        read = sbx.instances.egress(stack.instance)
        assert [c.secret for c in read.credentials] == [SECRET]
        kept = sbx.instances.set_egress(stack.instance, read.allow)  # credentials unchanged
        assert kept.credentials[0].to_dict() == read.credentials[0].to_dict()
        cred = EgressCredential(secret=SECRET, destinations=[f"{API}:8443"], header="X-Api-Key")
        got = sbx.instances.set_egress(stack.instance, read.allow, credentials=[cred])
        assert [(c.header, c.destinations) for c in got.credentials] == [
            ("X-Api-Key", [f"{API}:8443"])
        ]
        with pytest.raises(ValidationFailed, match=r"body\.credentials\.0\.secret"):
            sbx.instances.set_egress(
                stack.instance,
                read.allow,
                credentials=[{"secret": "NOPE", "destinations": [f"{API}:8443"]}],
            )
        none = sbx.instances.set_egress(stack.instance, read.allow, credentials=[])
        assert none.credentials == []
