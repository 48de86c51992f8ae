"""A real guest's agent follows a leader failover: two servers on a private PostgreSQL and one
data dir, on the real libvirtd; the guest is provisioned through the leader; the leader is
killed (-9) while a session prints; the follower leads, takes the fleet over, binds the guest
link gateway on the same address, and the guest's agent — through its QEMU forward, which
reconnects on its own — links with it. The session started before the failover goes on, every
line of it there, and is writable through the new leader."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.postgres.test_cluster_servers import roles
from tests.support.e2e import (
    NAME_PREFIX,
    REAL_SERVER_ENV,
    RECIPE,
    domains_under,
    forget_pools,
    provision,
    require_real_libvirt,
    wait_op,
)
from tests.support.ptyclient import PtyClient
from tests.support.server import ROOT, ServerProcess, free_port

pytestmark = pytest.mark.timeout(1500)

GUEST = f"{NAME_PREFIX}failover"
TIMEOUT = 120.0


@pytest.fixture
def nodes() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    require_real_libvirt()
    base = Path(tempfile.mkdtemp(prefix="sbx-failover-", dir="/var/tmp"))
    base.chmod(0o755)  # QEMU (libvirt-qemu) traverses it; the postgres user runs its cluster
    pg = base / "pg"
    url = subprocess.run(
        [str(ROOT / "scripts/pg-test-cluster.sh"), "start", str(pg)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    data = base / "data"
    data.mkdir(mode=0o755)
    gateway = f"127.0.0.1:{free_port()}"  # one guest link address: the leader's, whichever
    made = [
        ServerProcess(
            data,
            env={
                **REAL_SERVER_ENV,
                "SANDBOX_NODE_NAME": name,
                "SANDBOX_DATABASE_URL": url,
                "SANDBOX_GUEST_LINK_LISTEN": gateway,
            },
            log_path=base / f"{name}.log",
        )
        for name in ("n1", "n2")
    ]
    try:
        for n in made:
            n.start(TIMEOUT)
        yield made[0], made[1]
    finally:
        leader = next((n for n in made if n.alive()), None)
        if leader is not None:
            status, op = leader.api("DELETE", f"/api/v2/admin/instances/{GUEST}")
            if status == 202:
                wait_op(leader, op, 300)
        for n in made:
            n.stop()
        subprocess.run([str(ROOT / "scripts/pg-test-cluster.sh"), "stop", str(pg)], check=False)
        leftovers = domains_under(base)
        forget_pools(data)
        shutil.rmtree(base, ignore_errors=True)
        assert leftovers == [], f"domains left behind: {leftovers}"


def agent_since(srv: ServerProcess, since: float, timeout: float = TIMEOUT) -> float:
    """Seconds until the guest's agent is connected to `srv` by a link made after `since`."""
    import datetime as dt

    deadline = time.monotonic() + timeout
    while True:
        status, agent = srv.api("GET", f"/api/v2/admin/agents/{GUEST}")
        at = agent.get("connected_at") if status == 200 else None
        if (
            at
            and agent["state"] == "connected"
            and dt.datetime.fromisoformat(at).timestamp() >= since
        ):
            return time.time() - since
        assert time.monotonic() < deadline, f"the guest's agent did not follow: {agent}"
        time.sleep(0.2)


async def test_a_guest_agent_follows_a_kill9_failover(
    nodes: tuple[ServerProcess, ServerProcess],
) -> None:
    n1, n2 = nodes
    leader, _ = roles(n1, n2, timeout=TIMEOUT)
    follower = n2 if leader is n1 else n1
    status, op = leader.api("POST", "/api/v2/admin/images", {"recipe": RECIPE})
    assert status == 202, op
    op = wait_op(leader, op, timeout=900)  # the tier's cached build
    assert op["state"] == "succeeded", op.get("error")
    op = provision(leader, {"id": GUEST, "image": RECIPE, "loadout": "minimal"}, timeout=1000)
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))

    sess = leader.ok(
        "POST",
        "/api/v2/admin/sessions",
        {
            "instance_id": GUEST,
            "command": [
                "sh",
                "-c",
                "stty -echo -opost; i=0; while [ $i -lt 600 ]; do i=$((i+1)); echo tick-$i; "
                "sleep 0.1; done; echo TICKS-DONE; while read l; do echo got:$l; done",
            ],
        },
    )
    sid = sess["id"]
    async with await PtyClient.connect(
        leader.ws_url, sid, leader.admin_token, from_offset=0
    ) as watcher:
        await watcher.wait_output(b"tick-20\n", timeout=60)
        offset = watcher.next
    killed = time.time()
    leader.kill9()
    new, _ = roles(follower, timeout=TIMEOUT)
    assert new is follower
    took = agent_since(follower, killed)
    print(f"the guest's agent linked with the new leader {took:.1f} s after the kill")

    inst = follower.ok("GET", f"/api/v2/admin/instances/{GUEST}")
    assert inst["state"] == "running", inst
    async with await PtyClient.connect(
        follower.ws_url, sid, follower.admin_token, from_offset=offset
    ) as again:
        await again.wait_output(b"TICKS-DONE", timeout=180)
        assert not again.resyncs, again.resyncs[:1]
        lines = (bytes(watcher.data) + bytes(again.data)).decode(errors="replace").split()
        ticks = [ln for ln in lines if ln.startswith("tick-")]
        assert ticks == [f"tick-{i}" for i in range(1, 601)]  # every line once, in order
        async with await PtyClient.connect(
            follower.ws_url, sid, follower.admin_token, role="control"
        ) as ctl:
            await ctl.send_input(b"after\n")
            await again.wait_output(b"got:after", timeout=60)
