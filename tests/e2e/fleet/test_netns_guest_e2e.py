"""Hypervisors across a network with a real guest: a server whose hosts are two namespace
hypervisors (`tests/support/netns_libvirt.py`, ``qemu+tcp://`` to a private libvirtd in each),
their guests reaching it at each host's `control_address` (the host side of its veth, where the
guest link gateway listens: ``SANDBOX_GUEST_LINK_ADDRESSES``).

One real Debian guest (the tier's cached `debian-12-agent` build, one cold TCG boot) is placed on
a namespace host; it enrolls through that host's control address, serves a session typed into
over the WebSocket and runs an A2A task. A second create (defined, not started: no second boot)
lands on the other host. The guest's host is cut off (``ip link set … down``): its instance is
`unknown`, placements skip the host, the agent link goes down while the session keeps writing;
the link back up: reconciled (`running`), the agent reconnected, and the session's output, read
again from the offset where the cut began, is every byte the guest wrote, once, in order.

It passed end to end in 236 s on a quiet 2-core machine (the cold boot is most of it); under
load ~9 the boot alone took 12 to 15 minutes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import libvirt
import pytest
from a2a.types import a2a_pb2 as pb

from tests.support.a2a_sdk_client import a2a_client, collect, send_request, state_name
from tests.support.e2e import NAME_PREFIX, RECIPE, libvirt_server, wait_agent, wait_op
from tests.support.netns_libvirt import NamespaceHypervisor
from tests.support.ptyclient import PtyClient
from tests.support.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.libvirt_real, pytest.mark.timeout(2400)]

GUEST = f"{NAME_PREFIX}far"
DEFINED = f"{NAME_PREFIX}far-defined"
SKIPPED = f"{NAME_PREFIX}far-skip"
PINNED = f"{NAME_PREFIX}far-pinned"
FINAL = {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"}
TICK = re.compile(rb"tick-(\d+)-x{32}\r\n")


class Far:
    def __init__(self, server: ServerProcess, hosts: dict[str, NamespaceHypervisor]) -> None:
        self.server = server
        self.hosts = hosts


@pytest.fixture(scope="module")
def far() -> Iterator[Far]:
    if os.geteuid() != 0:
        pytest.fail("namespace hypervisors need root (ip netns, unshare -m)")
    with NamespaceHypervisor("na") as na, NamespaceHypervisor("nb") as nb:
        addresses = json.dumps([na.control_address, nb.control_address])
        with libvirt_server(
            "sbx-e2e-far-",
            SANDBOX_GUEST_LINK_ADDRESSES=addresses,
            SANDBOX_PROVISION_READY_TIMEOUT_SECONDS="900",
            SANDBOX_HOST_KEEPALIVE_SECONDS="1",
            SANDBOX_HOST_KEEPALIVE_COUNT="3",
            SANDBOX_HOST_RECONNECT_MAX_SECONDS="2",
        ) as srv:
            try:
                for name, h in (("na", na), ("nb", nb)):
                    status, out = srv.api(
                        "POST",
                        "/api/v2/admin/hosts",
                        {
                            "name": name,
                            "uri": h.uri,
                            "control_address": h.control_address,
                            "accel": "tcg",
                            "files": "remote",
                            "data_dir": h.data_dir,
                        },
                    )
                    assert status == 201, out
                    assert out["state"] == "reachable" and out["control_address"] == (
                        h.control_address
                    ), out
                # the control host takes no guests here: every placement is a namespace host
                srv.ok("POST", "/api/v2/admin/hosts/local/drain")
                yield Far(srv, {"na": na, "nb": nb})
            finally:
                for h in (na, nb):
                    h.link(up=True)
                for iid in (GUEST, DEFINED, SKIPPED, PINNED):
                    srv.api("DELETE", f"/api/v2/admin/instances/{iid}")


def _wait(check: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"still not true after {timeout}s: {what}"
        time.sleep(0.5)


def _state(srv: ServerProcess, iid: str) -> str:
    return str(srv.ok("GET", f"/api/v2/admin/instances/{iid}")["state"])


def _create(srv: ServerProcess, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    status, op = srv.api("POST", "/api/v2/admin/instances", body)
    assert status == 202, op
    return wait_op(srv, op, timeout)


def _domain_xml(h: NamespaceHypervisor, iid: str) -> str:
    conn = libvirt.open(h.uri)
    try:
        for dom in conn.listAllDomains(0):
            xml = dom.XMLDesc(0)
            if iid in dom.name() or f">{iid}<" in xml:
                return str(xml)
    finally:
        conn.close()
    raise AssertionError(f"no domain of {iid} on {h.uri}")


def _gateway_peers(h: NamespaceHypervisor, port: int) -> list[str]:
    """Established TCP connections to the guest link gateway at this host's control address,
    as seen on the control host: their peers."""
    out = subprocess.run(
        ["ss", "-tnH", "state", "established", "src", f"{h.control_address}:{port}"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()]


async def _a2a(srv: ServerProcess, iid: str, text: str) -> pb.Task:
    key = srv.ok(
        "POST",
        "/api/v2/admin/api-keys",
        {"instance_id": iid, "scopes": ["a2a:read", "a2a:invoke"]},
    )["key"]
    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=f"m-{os.urandom(8).hex()}")
    msg.parts.append(pb.Part(text=text))
    async with a2a_client(f"{srv.url}/agents/{iid}", key, "JSONRPC", streaming=False) as (c, _):
        # submitted, then polled: a TCG guest on a loaded machine may take longer than one
        # HTTP read (60 s) to run it
        (ev,) = await collect(c.send_message(send_request(msg, return_immediately=True)))
        deadline = time.monotonic() + 600
        task = ev.task
        while state_name(task) not in FINAL and time.monotonic() < deadline:
            await asyncio.sleep(1)
            task = await c.get_task(pb.GetTaskRequest(id=task.id))
        return task


async def _poll(check: Callable[[], Any], what: str, timeout: float) -> Any:
    return await asyncio.to_thread(_wait, check, what, timeout)


async def test_a_real_guest_on_a_namespace_host_enrolls_serves_and_outlives_a_link_cut(
    far: Far,
) -> None:
    srv = far.server
    status, op = srv.api("POST", "/api/v2/admin/images", {"recipe": RECIPE})
    assert status == 202, op
    op = await asyncio.to_thread(wait_op, srv, op, 900)
    assert op["state"] == "succeeded", op.get("error")

    # ---- placed on a namespace host, enrolled through its control address -------------------
    op = await asyncio.to_thread(
        _create, srv, {"id": GUEST, "image": RECIPE, "loadout": "minimal"}, 1000
    )
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"), srv.log_tail(40))
    inst = srv.ok("GET", f"/api/v2/admin/instances/{GUEST}")
    assert inst["state"] == "running" and inst["host"] in far.hosts, inst
    name = inst["host"]
    other = next(n for n in far.hosts if n != name)
    h = far.hosts[name]
    xml = _domain_xml(h, GUEST)
    # the guest's one forward leads to the gateway at this host's control address
    fwd = re.findall(r"guestfwd=tcp:[0-9.]+:(\d+)-tcp:([0-9.]+):(\d+)", xml)
    assert [(a, b) for _, a, b in fwd] == [(h.control_address, str(srv.guest_port))], xml
    # the agent's link: QEMU (in the namespace) to the gateway on the control address
    assert h.address in _gateway_peers(h, srv.guest_port), _gateway_peers(h, srv.guest_port)
    assert srv.ok("GET", f"/api/v2/admin/agents/{GUEST}")["state"] == "connected"
    hosts = {x["name"]: x for x in srv.ok("GET", "/api/v2/admin/hosts")["items"]}
    assert hosts[name]["instances"] == 1 and hosts[name]["state"] == "reachable", hosts

    # ---- the second create goes to the other host (defined only: no second boot) ------------
    op = await asyncio.to_thread(
        _create, srv, {"id": DEFINED, "image": RECIPE, "loadout": "minimal", "start": False}, 600
    )
    assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
    assert srv.ok("GET", f"/api/v2/admin/instances/{DEFINED}")["host"] == other

    # ---- an A2A task, and a session typed into over the WebSocket ---------------------------
    task = await _a2a(srv, GUEST, "echo far-task=$(hostname) $((6*7))")
    assert state_name(task) == "TASK_STATE_COMPLETED", task.status
    assert f"far-task={GUEST} 42" in "".join(p.text for a in task.artifacts for p in a.parts)

    sess = srv.ok(
        "POST",
        "/api/v2/admin/sessions",
        {"instance_id": GUEST, "command": ["bash", "-l"], "cols": 200, "rows": 50},
        timeout=300,
    )
    pad = "x" * 32
    loop = (
        f"i=0; while [ ! -e /tmp/stop-ticks ]; do i=$((i+1)); echo tick-$i-{pad} "
        f"| tee -a /tmp/ticks; sleep 0.2; done; echo TICKS-DONE-$((6*7))\r"
    )
    async with await PtyClient.connect(
        srv.ws_url, sess["id"], srv.admin_token, role="control", from_offset=0
    ) as c:
        await c.send_input(loop.encode())
        await c.wait_output(b"tick-5-" + pad.encode(), timeout=300)

        # ---- the link goes down: unknown, skipped, the agent's link lost ---------------------
        h.link(up=False)
        cut_at = c.next or 0
        cut_started = time.monotonic()
        await _poll(lambda: _state(srv, GUEST) == "unknown", f"{GUEST} unknown", 60)
        host = srv.ok("GET", f"/api/v2/admin/hosts/{name}")
        assert host["state"] == "unreachable", host
        op = await asyncio.to_thread(
            _create,
            srv,
            {"id": SKIPPED, "image": RECIPE, "loadout": "minimal", "start": False},
            600,
        )
        assert op["state"] == "succeeded", (op.get("error"), op.get("stages"))
        assert srv.ok("GET", f"/api/v2/admin/instances/{SKIPPED}")["host"] == other
        status, op = srv.api(
            "POST",
            "/api/v2/admin/instances",
            {"id": PINNED, "image": RECIPE, "loadout": "minimal", "start": False, "host": name},
        )
        if status == 202:
            op = await asyncio.to_thread(wait_op, srv, op, 600)
            assert op["state"] == "failed", op
            # placement refuses it, naming the host and why ("… {name}: unreachable")
            assert op["error"]["stage"] == "placing", op["error"]
            assert f"{name}: unreachable" in op["error"]["cause"], op["error"]
        else:
            assert status in (409, 422, 503), (status, op)
        status, pinned = srv.api("GET", f"/api/v2/admin/instances/{PINNED}")
        assert (
            status == 404
            or pinned.get("host") != name
            or pinned["state"]
            in (
                "failed",
                "deleted",
            )
        ), pinned
        await _poll(
            lambda: srv.ok("GET", f"/api/v2/admin/agents/{GUEST}")["state"] == "disconnected",
            "the agent's link closed during the cut (12 silent heartbeats)",
            180,
        )
        assert (c.next or 0) - cut_at < 4096, "output crossed a cut link?"
        cut_seconds = time.monotonic() - cut_started

        # ---- the link back up: reconciled, reconnected, nothing lost --------------------------
        h.link(up=True)
        await _poll(lambda: _state(srv, GUEST) == "running", f"{GUEST} reconciled", 120)
        back = await asyncio.to_thread(wait_agent, srv, GUEST, 240)
        assert h.address in _gateway_peers(h, srv.guest_port)
        status, out = srv.api(
            "POST",
            f"/api/v2/admin/instances/{GUEST}/exec",
            {"argv": ["touch", "/tmp/stop-ticks"]},
            timeout=300,
        )
        assert status == 200 and out["exit_code"] == 0, (status, out)
        await c.wait_output(b"TICKS-DONE-42", timeout=300)
        end = c.next or 0
        seen = bytes(c.data)

    # read again from where the cut began: the same bytes, to the same end
    async with await PtyClient.connect(
        srv.ws_url, sess["id"], srv.admin_token, role="observe", from_offset=cut_at
    ) as again:
        await again.wait_offset(end, timeout=60)
        assert again.start == cut_at and not again.resyncs, (again.start, again.resyncs)
        assert bytes(again.data[: end - cut_at]) == seen[cut_at:end]
    ticks = [int(n) for n in TICK.findall(seen)]
    assert ticks == list(range(1, len(ticks) + 1)), ticks
    during = [int(n) for n in TICK.findall(seen[cut_at:])]
    status, out = srv.api(
        "POST",
        f"/api/v2/admin/instances/{GUEST}/exec",
        {"argv": ["cat", "/tmp/ticks"]},
        timeout=300,
    )
    assert status == 200, out
    written = out["stdout"]["data"]
    assert written == "".join(f"tick-{i}-{pad}\n" for i in ticks), written[-400:]
    print(
        f"cut {cut_seconds:.1f}s; agent back {back:.1f}s after the link; {len(ticks)} ticks, "
        f"{len(during)} from the cut on; {end - cut_at} bytes after the cut offset"
    )
