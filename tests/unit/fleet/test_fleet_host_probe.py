"""A network host is first reached with a bounded TCP connect (libvirt.open has none)."""

from __future__ import annotations

import socket
import time

from agentic_sandbox.fleet.libvirt.host import network_endpoint, probe_endpoint


def test_network_uris_name_where_libvirt_listens() -> None:
    assert network_endpoint("qemu+tcp://198.18.0.2/system") == ("198.18.0.2", 16509)
    assert network_endpoint("qemu+tcp://198.18.0.2:17000/system") == ("198.18.0.2", 17000)
    assert network_endpoint("qemu+tls://h.example/system") == ("h.example", 16514)
    assert network_endpoint("qemu+ssh://root@[fd00::2]/system") == ("fd00::2", 22)
    for local in ("qemu:///system", "qemu+unix:///system?socket=/x", "test:///default"):
        assert network_endpoint(local) is None


async def test_a_closed_port_is_told_at_once() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    why = await probe_endpoint(("127.0.0.1", port))
    assert why.startswith(f"127.0.0.1:{port}: ") and "refused" in why.lower()


async def test_an_open_port_answers_and_a_silent_one_times_out() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(0)
        endpoint = listening.getsockname()
        assert await probe_endpoint(endpoint) == ""
        # a full accept queue drops further SYNs: what a host whose packets vanish looks like
        fillers = []
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(endpoint)
            fillers.append(c)
        time.sleep(0.05)
        started = time.monotonic()
        why = await probe_endpoint(endpoint, within=0.5)
        assert why == f"no answer from 127.0.0.1:{endpoint[1]} within 0.5s"
        assert time.monotonic() - started < 2
        for c in fillers:
            c.close()
