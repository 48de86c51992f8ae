"""Two real `sandbox-server` processes on one PostgreSQL and one data dir: exactly one leads,
the follower names it, serves reads and answers writes 307 to it; when the leader stops
(SIGTERM), dies (kill -9) or loses its lock connection (exit 75), the follower leads."""

from __future__ import annotations

import http.client
import json
import shutil
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from agentic_sandbox.images import ImageStore
from tests.support.fake_images import publish_fake
from tests.support.fixtures import TEST_SERVER_ENV
from tests.support.libvirt_testdriver import node_uri
from tests.support.server import ServerProcess
from tests.support.sessions import events

IMAGE = "fake-0123456789ab"
TIMEOUT = 60.0  # generous for a loaded 2-core machine; every wait polls a condition


def request(
    srv: ServerProcess, method: str, path: str, body: Any = None, token: str | None = None
) -> tuple[int, dict[str, str], Any]:
    """One request, redirects not followed."""
    u = urllib.parse.urlsplit(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    headers = {"Authorization": f"Bearer {token or srv.admin_token}"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw or b"null")
    finally:
        conn.close()


def ready(srv: ServerProcess) -> dict[str, Any] | None:
    if not srv.alive():
        return None
    try:
        _, _, doc = request(srv, "GET", "/readyz")
    except OSError:
        return None
    return doc if isinstance(doc, dict) else None


def roles(*nodes: ServerProcess, timeout: float = TIMEOUT) -> tuple[ServerProcess, list[Any]]:
    """Wait until exactly one node says `leader` and every other live one follows it."""
    deadline = time.monotonic() + timeout
    last: list[Any] = []
    while time.monotonic() < deadline:
        last = [ready(n) for n in nodes]
        leaders = [
            n
            for n, d in zip(nodes, last, strict=True)
            if d and d["role"] == "leader" and d["status"] == "ready"  # its components run
        ]
        if len(leaders) == 1:
            name = last[nodes.index(leaders[0])]["node"]
            others = [d for n, d in zip(nodes, last, strict=True) if n is not leaders[0]]
            if all(
                d is not None
                and d["role"] == "follower"
                and d["leader"] == {"node": name, "url": leaders[0].url}
                for d in others
                if d is not None
            ):
                return leaders[0], last
        time.sleep(0.1)
    raise AssertionError(f"no single leader within {timeout:.0f}s: {last}")


def node(tmp_path: Path, pg_url: str, name: str) -> ServerProcess:
    return ServerProcess(
        tmp_path / "data",  # one data dir shared by the nodes
        env={"SANDBOX_NODE_NAME": name, "SANDBOX_DATABASE_URL": pg_url},
        log_path=tmp_path / f"{name}.log",
    )


def wait_exit(srv: ServerProcess, timeout: float = TIMEOUT) -> int:
    assert srv.proc is not None
    return srv.proc.wait(timeout)


async def test_two_servers_one_leader_redirect_and_failover(pg_url: str, tmp_path: Path) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    try:
        n1.start(TIMEOUT)
        n2.start(TIMEOUT)
        leader, docs = roles(n1, n2)
        follower = n2 if leader is n1 else n1
        term = docs[(n1, n2).index(leader)]["term"]
        assert term >= 1 and docs[(n1, n2).index(follower)]["term"] == term

        # the follower serves reads of the shared database itself
        status, _, body = request(follower, "GET", "/api/v2/admin/instances")
        assert status == 200 and body == {"items": []}
        status, _, body = request(follower, "GET", "/api/v2/admin/audit?limit=5")
        assert status == 200 and isinstance(body["items"], list)

        # a write on the follower: 307 to the same path and query on the leader
        path = "/api/v2/admin/tokens?x=1"
        status, headers, problem = request(
            follower, "POST", path, {"subject": "bob", "role": "operator"}
        )
        assert status == 307, (status, problem)
        assert headers["location"] == leader.url + path
        lname = "n1" if leader is n1 else "n2"
        assert headers["sandbox-leader"] == f"{lname} {leader.url}"
        assert headers["content-type"].startswith("application/problem+json")
        assert problem["type"].endswith("not-leader") and problem["leader_url"] == leader.url
        # … where it is served
        status, _, made = request(
            leader, "POST", "/api/v2/admin/tokens", {"subject": "bob", "role": "operator"}
        )
        assert status == 201 and made["token"]
        # anything held in the leader's memory goes there too, GET or not
        path = "/api/v2/admin/sessions"
        status, headers, _ = request(follower, "GET", path)
        assert status == 307 and headers["location"] == leader.url + path

        # a graceful stop hands over: the follower leads at the next term
        assert leader.stop(TIMEOUT) == 0
        new_leader, docs = roles(follower)
        assert new_leader is follower and docs[0]["term"] == term + 1
        status, _, _ = request(
            follower, "POST", "/api/v2/admin/tokens", {"subject": "c", "role": "viewer"}
        )
        assert status == 201

        # the old leader comes back as a follower of the new one
        leader.start(TIMEOUT)
        again, docs = roles(n1, n2)
        assert again is follower

        # kill -9 of the leader: the follower takes over
        follower.kill9()
        third, docs = roles(leader)
        assert third is leader and docs[0]["term"] == term + 2
        status, _, _ = request(
            leader, "POST", "/api/v2/admin/tokens", {"subject": "d", "role": "viewer"}
        )
        assert status == 201

        # each new term's first event says who leads now and who led before (a kill -9 too)
        fname = "n2" if lname == "n1" else "n1"
        changes = [
            (e["data"]["node"], e["data"]["term"], e["data"]["previous"], e["data"]["url"])
            for e in events(leader, "cluster.leader_changed")
        ]
        assert changes[0][:2] == (lname, term)
        assert changes[1:] == [
            (fname, term + 1, lname, follower.url),
            (lname, term + 2, fname, leader.url),
        ]
    finally:
        n1.stop()
        n2.stop()


async def test_leader_that_loses_its_lock_connection_exits_75(pg_url: str, tmp_path: Path) -> None:
    n1, n2 = node(tmp_path, pg_url, "n1"), node(tmp_path, pg_url, "n2")
    admin = create_async_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        n1.start(TIMEOUT)
        roles(n1)
        n2.start(TIMEOUT)
        leader, _ = roles(n1, n2)
        assert leader is n1
        async with admin.connect() as conn:
            killed = (
                await conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = 'sandbox-elector:n1'"
                    )
                )
            ).scalar()
        assert killed == 1
        assert wait_exit(n1) == 75
        assert "lost leadership" in n1.log_text()
        new, _ = roles(n2)
        assert new is n2
    finally:
        await admin.dispose()
        n1.stop()
        n2.stop()


async def test_an_operation_the_dead_leader_ran_fails_naming_the_failover(
    pg_url: str, tmp_path: Path
) -> None:
    """A provision still waiting for its agent when the leader is killed: the new leader
    fails it, saying which leader stopped and who leads now, as the row and as an event."""
    # readiness checks that QEMU's user can traverse to the disks: not below pytest's 0700
    # folders (which any other pytest run on the machine resets to 0700)
    data = Path(tempfile.mkdtemp(prefix="failover-op-", dir="/var/tmp"))
    data.chmod(0o755)
    env = {
        **TEST_SERVER_ENV,
        "SANDBOX_LIBVIRT_URI": node_uri(tmp_path, "hv"),
        "SANDBOX_KVM_PROBE": "false",
    }
    n1 = ServerProcess(
        data / "data",
        env={**env, "SANDBOX_NODE_NAME": "n1", "SANDBOX_DATABASE_URL": pg_url},
        log_path=tmp_path / "n1.log",
    )
    n2 = ServerProcess(
        data / "data",
        env={**env, "SANDBOX_NODE_NAME": "n2", "SANDBOX_DATABASE_URL": pg_url},
        log_path=tmp_path / "n2.log",
    )
    publish_fake(ImageStore(n1.data_dir / "images"), IMAGE, recipe_name="fake")
    try:
        n1.start(TIMEOUT)
        assert roles(n1)[0] is n1
        n2.start(TIMEOUT)
        roles(n1, n2)
        # no agent enrolls on the test driver: the provision waits for it, running
        status, _, op = request(
            n1, "POST", "/api/v2/admin/instances", {"id": "w-1", "image": IMAGE}
        )
        assert status == 202, op
        deadline = time.monotonic() + TIMEOUT
        while op["stage"] != "enrolling":
            assert time.monotonic() < deadline and op["state"] == "running", op
            time.sleep(0.2)
            _, _, op = request(n1, "GET", f"/api/v2/admin/operations/{op['id']}")

        n1.kill9()
        leader, docs = roles(n2)
        assert leader is n2
        term = docs[0]["term"]
        status, _, after = request(n2, "GET", f"/api/v2/admin/operations/{op['id']}")
        assert status == 200, after
        cause = f"the leader n1 stopped; n2 leads now (term {term})"
        assert after["state"] == "failed", after
        assert after["error"] == {"stage": "enrolling", "cause": cause}, after
        failed = [
            e["data"]
            for e in events(n2, "operation.failed")
            if e["data"]["operation_id"] == op["id"]
        ]
        assert failed == [
            {
                "operation_id": op["id"],
                "kind": "provision",
                "subject": "w-1",
                "error": {"stage": "enrolling", "cause": cause},
            }
        ]
    finally:
        n1.stop()
        n2.stop()
        shutil.rmtree(data, ignore_errors=True)
