"""The security tier: one real server (fleet on libvirt's test driver) with one host agent,
and alice's objects on it, shared by every test in this folder that needs no special settings.

Credential kinds (the columns of the auth matrix):

| kind      | what it is                                                  |
|-----------|-------------------------------------------------------------|
| `none`    | no credential at all                                        |
| `wrong`   | a well-formed operator token the server never issued        |
| `revoked` | a real operator token, revoked before the tests start        |
| `viewer`  | a viewer token (subject `vera`, owns nothing)               |
| `owner`   | alice's operator token: she owns every object below          |
| `admin`   | the bootstrap admin token                                   |
| `apikey`  | an A2A API key bound to alice's instance (both scopes)      |
| `other`   | bob's operator token: another owner                         |

alice's objects: a host instance with a live agent, a shell session on it, a finished v1 task,
a secret, an A2A API key and her token itself. `markers` are their identifiers: no answer to
anyone but alice and the admin may contain one that the request itself did not name.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.support.agents import AgentProcess, enrollment_token, register_host_instance
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.libvirt_testdriver import node_uri
from tests.support.server import ServerProcess

KINDS = ("none", "wrong", "revoked", "viewer", "owner", "admin", "apikey", "other")
INSTANCE = "sec-alice"
SHELL = ["bash", "--norc", "--noprofile", "-i"]
SHELL_ENV = {"PS1": "PROMPT> ", "HISTFILE": "/dev/null"}

# Many refusals from one address are the point of the matrix: its server lets them all be
# answered 401/403 (the refusal rate limit has its own tests); SSE keepalives come quickly so a
# reader knows the replay is over.
STACK_ENV = {
    **TEST_SERVER_ENV,
    "SANDBOX_AUTH_REFUSAL_BURST": "1000000",
    "SANDBOX_AUTH_REFUSALS_PER_MINUTE": "1000000",
    "SANDBOX_SSE_KEEPALIVE_SECONDS": "0.3",
    "SANDBOX_KVM_PROBE": "false",
}


@dataclass
class Stack:
    server: ServerProcess
    agent: AgentProcess
    tokens: dict[str, str | None]  # kind -> bearer value (None: no credential)
    ids: dict[str, str]  # alice's objects: instance, session, task, token, key, secret
    token_ids: dict[str, str] = field(default_factory=dict)  # kind -> its token's id

    @property
    def markers(self) -> list[str]:
        return [v for k, v in self.ids.items() if k != "secret_value"]

    def headers(self, kind: str) -> dict[str, str]:
        token = self.tokens[kind]
        return {"Authorization": f"Bearer {token}"} if token else {}


def _wait_task(server: ServerProcess, task_id: str, token: str) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while True:
        out: dict[str, object] = server.ok("GET", f"/api/v1/tasks/{task_id}", token=token)
        if out["state"] in ("completed", "failed", "canceled", "rejected"):
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} stayed {out['state']}")
        time.sleep(0.1)


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("security")
    env = {**STACK_ENV, "SANDBOX_LIBVIRT_URI": node_uri(root, "local")}
    server = ServerProcess(root / "srv", env=env).start()
    agent: AgentProcess | None = None
    try:
        alice = server.make_token("alice", "operator")
        tokens: dict[str, str | None] = {
            "none": None,
            "wrong": "sbx_" + secrets.token_urlsafe(32),
            "revoked": server.make_token("rita", "operator"),
            "viewer": server.make_token("vera", "viewer"),
            "owner": alice,
            "admin": server.admin_token,
            "other": server.make_token("bob", "operator"),
        }
        token_ids = {
            kind: str(server.ok("GET", "/api/v2/admin/whoami", token=tok)["credential_id"])
            for kind, tok in tokens.items()
            if tok and kind != "wrong"
        }
        server.ok("DELETE", f"/api/v2/admin/tokens/{token_ids['revoked']}")

        home = root / "task-home"
        home.mkdir()
        register_host_instance(
            server,
            INSTANCE,
            token=alice,
            task_runner={"argv": ["bash", "-lc", "{text}"], "env": {"HOME": str(home)}},
        )
        grant = enrollment_token(server, INSTANCE, token=alice)
        agent = AgentProcess(server, INSTANCE, root / "agent", enrollment_token=grant)
        agent.start()
        agent.wait_connected()
        session = server.ok(
            "POST",
            "/api/v2/admin/sessions",
            {"instance_id": INSTANCE, "command": SHELL, "env": SHELL_ENV},
            token=alice,
        )
        task = server.ok(
            "POST",
            "/api/v1/tasks",
            {"instance_id": INSTANCE, "command": "echo alice-task-$((6*7))"},
            token=alice,
        )
        _wait_task(server, str(task["id"]), alice)
        server.ok(
            "PUT",
            "/api/v2/admin/secrets/ALICE_DEPLOY_KEY",
            {"value": "alice-secret-" + secrets.token_hex(8)},
            token=alice,
        )
        key = server.ok(
            "POST",
            "/api/v2/admin/api-keys",
            {"instance_id": INSTANCE, "scopes": ["a2a:read", "a2a:invoke"]},
            token=alice,
        )
        tokens["apikey"] = str(key["key"])
        ids = {
            "instance": INSTANCE,
            "session": str(session["id"]),
            "task": str(task["id"]),
            "token": token_ids["owner"],
            "key": str(key["id"]),
            "secret": "ALICE_DEPLOY_KEY",
            "subject": "alice",
        }
        yield Stack(server, agent, tokens, ids, token_ids)
    finally:
        if agent is not None:
            agent.stop()
        server.stop()
        log = server.log_text()
        assert "unhandled error" not in log, "the server logged an unhandled error"
