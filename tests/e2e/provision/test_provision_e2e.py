"""End to end on real libvirtd + QEMU (TCG): an image built by `images` (cached across runs), a
cold provision whose agent enrolls over mTLS from inside the guest, a WebSocket typing into a
shell in that VM, a memory snapshot cloned under a new identity, isolation checked from inside,
failures that leave nothing behind, and provision-vm.sh without a server.

One server for the module; the image and the cold guest are module fixtures, so each test
runs alone as well as in the module (where they are made once and shared).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.e2e import (
    CACHE,
    NAME_PREFIX,
    RECIPE,
    domains_named,
    forget_pools,
    libvirt_server,
    provision,
    wait_agent,
    wait_op,
)
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]  # a cold TCG boot on a loaded machine

ROOT = Path(__file__).resolve().parents[3]
COLD = "e2e-cold"
CLONE = "e2e-clone"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # a shared 2-core machine under load boots TCG guests several times slower than alone
    with libvirt_server("sbx-e2e-", SANDBOX_PROVISION_READY_TIMEOUT_SECONDS="900") as srv:
        try:
            yield srv
        finally:
            for iid in (COLD, CLONE, "e2e-slow", "e2e-huge", f"{NAME_PREFIX}pooled"):
                srv.api("DELETE", f"/api/v2/admin/instances/{iid}")


# Every test asks for what it needs (the image, the cold guest) through these fixtures, so any
# one of them runs alone; run together, the module builds (or reuses) the image and boots the
# cold guest once.
@pytest.fixture(scope="module")
def image(server: ServerProcess) -> dict[str, Any]:
    """The recipe's image, built or reused from the cache: the finished build operation."""
    status, op = server.api("POST", "/api/v2/admin/images", {"recipe": RECIPE})
    assert status == 202, op
    op = wait_op(server, op, timeout=900)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    return op


@pytest.fixture(scope="module")
def cold_op(server: ServerProcess, image: dict[str, Any]) -> dict[str, Any]:
    """The cold provision of COLD (once per module): its finished operation."""
    op = provision(server, {"id": COLD, "image": RECIPE, "loadout": "minimal"}, timeout=1000)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    return op


@pytest.fixture
def cold(server: ServerProcess, cold_op: dict[str, Any]) -> str:
    """COLD with its agent connected (a test before may have snapshotted it or killed its
    agent: both reconnect)."""
    wait_agent(server, COLD)
    return COLD


async def run_in_session(
    srv: ServerProcess, instance: str, script: str, marker: str, timeout: float = 60
) -> str:
    """Open a login shell on the instance, type `script` over the WebSocket, return the output
    up to `marker`."""
    sess = srv.ok(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": instance, "command": ["bash", "-l"], "cols": 200, "rows": 50},
    )
    async with await PtyClient.connect(
        srv.ws_url, sess["id"], srv.admin_token, role="control"
    ) as c:
        await c.send_input(script.encode() + b"; echo " + marker.encode() + b"-$((6*7))\r")
        await c.wait_output(f"{marker}-42".encode(), timeout=timeout)
        text = bytes(c.data).decode(errors="replace")
    srv.api("POST", f"/api/v2/admin/sessions/{sess['id']}/kill", {})
    return text


def test_image_builds_or_is_reused(server: ServerProcess, image: dict[str, Any]) -> None:
    op = image
    images = server.ok("GET", "/api/v2/admin/images")["items"]
    assert any(i["name"] == op["result"]["image"] for i in images)


def test_cold_provision_enrolls_and_a_websocket_types_in_the_guest(
    server: ServerProcess, cold_op: dict[str, Any]
) -> None:
    op = cold_op
    stages = [s["name"] for s in op["stages"]]
    assert stages[-2:] == ["enrolling", "ready"], stages
    inst = server.ok("GET", f"/api/v2/admin/instances/{COLD}")
    assert inst["state"] == "running" and inst["network_policy"] == "isolated"
    agents = server.ok("GET", "/api/v2/admin/agents")["items"]
    assert any(a["instance_id"] == COLD and a["state"] == "connected" for a in agents)

    out = asyncio.run(run_in_session(server, COLD, "uname -r; cat /etc/machine-id", "DONE"))
    assert re.search(r"\d+\.\d+\.\d+-\d+-cloud-amd64", out), out
    assert re.search(r"\b[0-9a-f]{32}\b", out), out


def test_a2a_task_runs_in_the_guest(server: ServerProcess, cold: str) -> None:
    """An orchestrator's A2A message becomes a run in a PTY inside the VM, as the agent user."""
    import json
    import urllib.request

    key = server.ok("POST", "/api/v2/admin/api-keys", {"instance_id": COLD})["key"]
    card = server.ok("GET", f"/agents/{COLD}/.well-known/agent-card.json", token="")
    assert card["name"] and card["signatures"]
    body = {
        "message": {
            "messageId": "e2e-m1",
            "role": "ROLE_USER",
            "parts": [{"text": "echo user=$(id -un) host=$(hostname); uname -r"}],
        }
    }
    req = urllib.request.Request(
        f"{server.url}/agents/{COLD}/message:send",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "A2A-Version": "1.0",
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        result = json.loads(resp.read())
    text = json.dumps(result)
    assert "TASK_STATE_COMPLETED" in text, text[:2000]
    assert f"user=agent host={COLD}" in text and "cloud-amd64" in text, text[:2000]


def guest_identity(server: ServerProcess, instance: str) -> dict[str, str]:
    out = asyncio.run(
        run_in_session(
            server,
            instance,
            "echo MID=$(cat /etc/machine-id) HOST=$(hostname) "
            "KEY=$(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f2)",
            "IDENT",
        )
    )
    line = next(x for x in out.splitlines() if x.startswith("MID=") and "$(" not in x)
    return dict(part.split("=", 1) for part in line.split())


def test_memory_snapshot_clone_has_its_own_identity(server: ServerProcess, cold: str) -> None:
    status, snap = server.api(
        "POST", f"/api/v2/admin/instances/{COLD}/snapshots", {"name": "golden", "memory": True}
    )
    assert status == 201, snap
    started = time.monotonic()
    status, op = server.api(
        "POST", f"/api/v2/admin/instances/{COLD}/clone", {"new_id": CLONE, "snapshot": "golden"}
    )
    assert status == 202, op
    op = wait_op(server, op, timeout=180)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    print(f"clone from memory snapshot ready in {time.monotonic() - started:.1f}s: {op['stages']}")
    for iid in (COLD, CLONE):
        inst = server.ok("GET", f"/api/v2/admin/instances/{iid}")
        assert inst["state"] == "running", inst
    # the source was saved and restored to take the snapshot: its agent reconnects
    print(f"source agent back after {wait_agent(server, COLD):.1f}s more")
    first, second = guest_identity(server, COLD), guest_identity(server, CLONE)
    assert first["HOST"] == COLD and second["HOST"] == CLONE
    assert first["MID"] != second["MID"]
    assert first["KEY"] != second["KEY"]
    agents = {a["instance_id"]: a for a in server.ok("GET", "/api/v2/admin/agents")["items"]}
    assert agents[COLD]["state"] == agents[CLONE]["state"] == "connected"
    assert agents[COLD].get("certificate_serial") != agents[CLONE].get("certificate_serial")
    # the clone's kernel took the seed's entropy and reseeded before any of that was made
    # (the agent logs to the console; the source's kernel did not need to)
    console = server.ok("GET", f"/api/v2/admin/instances/{CLONE}/console?tail=200000")["text"]
    assert "kernel random generator reseeded from the seed" in console, console[-3000:]
    assert "cannot reseed" not in console


def test_killed_agent_is_restarted_by_systemd_and_comes_back(
    server: ServerProcess, cold: str
) -> None:
    """kill -9 the agent inside the guest: systemd restarts it, the instance's agent goes
    away (stale or disconnected) and comes back connected."""
    sess = server.ok(
        "POST",
        "/api/v2/admin/sessions",
        {
            "instance_id": COLD,
            "user": "root",
            "command": [
                "bash",
                "-c",
                "kill -9 $(systemctl show -p MainPID --value agentic-sandbox-agent.service)",
            ],
        },
    )
    assert sess["id"]
    deadline = time.monotonic() + 60
    seen_away = False
    while time.monotonic() < deadline:
        state = server.ok("GET", f"/api/v2/admin/agents/{COLD}")["state"]
        if state != "connected":
            seen_away = True
            break
        time.sleep(0.2)
    assert seen_away, "the server never noticed the agent went away"
    back = wait_agent(server, COLD, timeout=120)
    print(f"agent back {back:.1f}s after the server noticed it was gone")
    events = server.ok("GET", f"/api/v1/events?instance_id={COLD}&type=agent.*&limit=200")
    kinds = [e["type"] for e in events["items"]]
    assert kinds.count("agent.connected") >= 2, kinds


def test_isolated_guest_reaches_only_the_agent_link(server: ServerProcess, cold: str) -> None:
    """From an unprivileged shell (user `agent`, no sudo): nothing but the agent's own ways
    out is there — the forward, and the link's virtio-serial port with the agent's loopback
    bridge to it — and those refuse every user but root, so no guest process can open them,
    displace the agent's connection or talk over it, however often it tries. The agent holds
    the port (it opens once at a time)."""
    http_port = server.http_port
    fwd = server.guest_port
    console = server.ok("GET", f"/api/v2/admin/instances/{COLD}/console?tail=400000")["text"]
    found = re.findall(
        r"the link goes through the port (\S+) \(bridged at 127\.0\.0\.1:(\d+)\)", console
    )
    assert found, "the agent does not use the link's virtio-serial port: " + console[-3000:]
    device, bridge = found[-1]
    holders = (  # every process that has a virtio port open, and whether it is the agent's
        "for f in $(find /proc/[0-9]*/fd -lname '/dev/vport*' 2>/dev/null); do p=${f#/proc/}; "
        "grep -q agentic-sandbox-agent.service /proc/${p%%/*}/cgroup && echo AGENT-HOLDS "
        "|| echo OTHER-HOLDS; done"
    )
    held = server.ok(
        "POST",
        f"/api/v2/admin/instances/{COLD}/exec",
        {"argv": ["bash", "-c", holders], "user": "root"},
    )["stdout"]["data"]
    assert held.split() == ["AGENT-HOLDS"], held
    script = (
        'probe(){ timeout 3 bash -c "</dev/tcp/$1/$2" 2>/dev/null && echo "OPEN $1:$2" '
        '|| echo "SHUT $1:$2"; }; '
        f"probe 10.0.2.2 {http_port}; probe 10.0.2.254 {http_port}; probe 10.0.2.3 53; "
        f"probe 10.0.2.2 {server.grpc_port}; probe 1.1.1.1 80; "
        f"for i in 1 2 3 4 5; do probe 10.0.2.2 {fwd}; done; "
        f"cat {device} </dev/null >/dev/null 2>&1 && echo OPEN-PORT || echo SHUT-PORT; "
        f"for i in 1 2 3; do probe 127.0.0.1 {bridge}; done; "
        "id -un"
    )
    before = time.time()
    out = asyncio.run(run_in_session(server, COLD, script, "NET", timeout=90))
    assert f"SHUT 10.0.2.2:{http_port}" in out, out
    assert f"SHUT 10.0.2.254:{http_port}" in out, out
    assert "SHUT 10.0.2.3:53" in out and "SHUT 1.1.1.1:80" in out, out
    lines = out.splitlines()
    assert sum(ln.strip() == f"SHUT 10.0.2.2:{fwd}" for ln in lines) == 5, out
    assert sum(ln.strip() == f"SHUT 127.0.0.1:{bridge}" for ln in lines) == 3, out
    port_probe = [ln.strip() for ln in lines if ln.strip() in ("SHUT-PORT", "OPEN-PORT")]
    assert port_probe == ["SHUT-PORT"], out
    assert not [ln for ln in lines if ln.startswith("OPEN ")], out
    assert "agent" in out.split()  # the probes ran as the unprivileged user
    drops = [
        e
        for e in server.ok(
            "GET", f"/api/v1/events?type=agent.disconnected&instance_id={COLD}&limit=200"
        )["items"]
        if dt.datetime.fromisoformat(e["time"]).timestamp() >= before
    ]
    assert drops == [], "a guest process displaced the agent's link"


def test_agent_that_never_enrolls_fails_at_enrolling_and_leaves_nothing(
    server: ServerProcess, image: dict[str, Any]
) -> None:
    op = provision(server, {"id": "e2e-slow", "image": RECIPE, "ready_timeout_seconds": 5})
    assert op["state"] == "failed", op
    assert op["error"]["stage"] == "enrolling" and "did not enroll" in op["error"]["cause"]
    assert server.api("GET", "/api/v2/admin/instances/e2e-slow")[0] == 404
    assert domains_named("e2e-slow") == []
    fleet_dir = server.data_dir / "fleet" / "instances"
    assert not list(fleet_dir.glob("*e2e-slow*"))
    import sqlite3

    with sqlite3.connect(server.data_dir / "sandbox.db") as db:
        (usable,) = db.execute(
            "select count(*) from enrollment_tokens where instance_id='e2e-slow' "
            "and used_at is null"
        ).fetchone()
    assert usable == 0, "the failed instance's enrollment token is still usable"


def test_libvirt_refusal_and_bad_input_leave_nothing(
    server: ServerProcess, image: dict[str, Any]
) -> None:
    op = provision(server, {"id": "e2e-huge", "image": RECIPE, "resources": {"memory_mib": 262144}})
    assert op["state"] == "failed" and op["error"]["stage"] in ("placing", "booting"), op
    status, body = server.api(
        "POST", "/api/v2/admin/instances", {"id": "e2e-bad", "image": "no-such-image"}
    )
    assert status == 422 and "body.image" in body["detail"]
    status, body = server.api(
        "POST", "/api/v2/admin/instances", {"id": "e2e-bad", "image": RECIPE, "loadout": "nope"}
    )
    assert status == 422 and "body.loadout" in body["detail"]
    assert domains_named("e2e-huge") == [] and domains_named("e2e-bad") == []


def test_provision_vm_sh_without_a_server(image: dict[str, Any]) -> None:
    """(`image`: the recipe's build in the cache, which the script boots from.)"""
    data = Path(tempfile.mkdtemp(prefix="sbx-e2e-direct-", dir="/var/tmp"))
    data.chmod(0o755)
    script = str(ROOT / "provision" / "provision-vm.sh")
    common = ["--no-server", "--data-dir", str(data), "--images-dir", str(CACHE)]
    bad = subprocess.run([script, "Not_Valid", *common], capture_output=True, text=True)
    assert bad.returncode == 2 and "NAME" in bad.stderr
    res = subprocess.run(
        [script, "e2e-direct", "--wait", "--json", "--timeout", "300", *common],
        capture_output=True,
        text=True,
        timeout=420,
    )
    try:
        assert res.returncode == 0, res.stderr
        import json

        out = json.loads(res.stdout)
        assert out["instance"]["state"] == "running" and out["server"] is None
        assert domains_named("e2e-direct")
    finally:
        gone = subprocess.run(
            [script, "e2e-direct", "--delete", *common], capture_output=True, text=True, timeout=120
        )
        leftovers = list((data / "fleet" / "instances").glob("*e2e-direct*"))
        forget_pools(data)
        shutil.rmtree(data, ignore_errors=True)
    assert gone.returncode == 0, gone.stderr
    assert domains_named("e2e-direct") == []
    assert leftovers == [], leftovers


def test_warm_pool_hand_off(server: ServerProcess, image: dict[str, Any]) -> None:
    pooled = f"{NAME_PREFIX}pooled"
    states = server.data_dir / "fleet" / "states"
    status, op = server.api(
        "POST", "/api/v2/admin/pools", {"image": RECIPE, "loadout": "minimal", "size": 1}
    )
    assert status == 202, op
    op = wait_op(server, op, timeout=600)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    deadline = time.monotonic() + 120
    while True:
        pools = server.ok("GET", "/api/v2/admin/pools")["items"]
        if pools and pools[0]["ready"] >= 1:
            break
        assert time.monotonic() < deadline, pools
        time.sleep(1)
    key = pools[0]["key"]

    def golden() -> set[str]:  # the pool's state: <key>-<image>.save and .qcow2
        return {p.name.rpartition(".")[2] for p in states.iterdir() if p.name.startswith(key)}

    assert golden() == {"save", "qcow2"}, golden()
    started = time.monotonic()
    # no from_pool: a create that matches a pool takes from it by default
    op = provision(server, {"id": pooled, "image": RECIPE}, timeout=120)
    elapsed = time.monotonic() - started
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    assert op["result"]["source"] == "pool", op["result"]
    print(f"warm-pool create to agent ready: {elapsed:.1f}s: {op['stages']}")
    ident = guest_identity(server, pooled)
    assert ident["HOST"] == pooled
    # every member of a pool wakes with the golden's random generator: reseeded at the hand-off
    console = server.ok("GET", f"/api/v2/admin/instances/{pooled}/console?tail=200000")["text"]
    assert "kernel random generator reseeded from the seed" in console, console[-3000:]
    # it stood by with a seed of its own: reseeded from that seed's entropy before it made
    # the key ahead, and the hand-off used that key (the whole story, in order, on its console)
    story = [
        "standing by in a warm pool as pool-",
        "kernel random generator reseeded from the seed",
        "agentic-sandbox: spare key ready",
        "using the key made while this guest stood by in the pool",
        f"enrolled as instance {pooled}",
    ]
    at = [console.find(line) for line in story]
    assert -1 not in at and at == sorted(at), (dict(zip(story, at, strict=True)), console[-3000:])
    # the pool goes while an instance taken from it still runs: its golden memory image goes
    # at once, the frozen disk the instance runs on stays until that instance is deleted
    server.ok("DELETE", f"/api/v2/admin/pools/{key}")
    assert server.ok("GET", "/api/v2/admin/pools")["items"] == []
    assert golden() == {"qcow2"}, golden()
    assert server.ok("GET", f"/api/v2/admin/agents/{pooled}")["state"] == "connected"
    server.ok("DELETE", f"/api/v2/admin/instances/{pooled}")
    assert golden() == set(), "the golden state's frozen disk was stranded"
