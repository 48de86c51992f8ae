"""The guest link gateway on more addresses than loopback (`guest_link_addresses`): the
control_address of hosts whose guests come over a network. An agent behind a forward to such an
address enrolls and links; the server certificate names the address; an address that cannot be
bound stops start-up naming the setting."""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from tests.support.agents import start_agent
from tests.support.fixtures import ServerFactory
from tests.support.guestfwd import GuestForward
from tests.support.ptyclient import PtyClient
from tests.support.sessions import SHELL, create_session

OTHER = "127.0.0.2"  # a second loopback address: another host's control_address, on this one


def _served_certificate(port: int) -> x509.Certificate:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


async def test_an_agent_reaches_the_server_through_a_gateway_address_beside_loopback(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(SANDBOX_GUEST_LINK_ADDRESSES=f'["{OTHER}"]')
    san = _served_certificate(server.enroll_port).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert ipaddress.ip_address(OTHER) in san.value.get_values_for_type(x509.IPAddress)
    fwd = GuestForward(f"{OTHER}:{server.guest_port}").start()
    iid = "via-other"
    try:
        agent = start_agent(server, iid, tmp_path, extra_args=["--gateway", fwd.address])
        sid = create_session(server, iid, SHELL)
        async with await PtyClient.connect(
            server.ws_url, sid, server.admin_token, role="control"
        ) as c:
            await c.send_input(b"echo far-$((40+2))\r")
            await c.wait_output(b"far-42")
        assert fwd.pipes_made == 1
        agent.stop()
    finally:
        fwd.stop()


def test_a_gateway_address_that_cannot_be_bound_stops_start_up_naming_it(
    server_factory: ServerFactory,
) -> None:
    # 203.0.113.0/24 (TEST-NET-3, documentation only) is on no interface here: binding fails
    with pytest.raises(RuntimeError) as err:
        server_factory(SANDBOX_GUEST_LINK_ADDRESSES='["203.0.113.254"]')
    assert "guest_link_addresses" in str(err.value) and "203.0.113.254" in str(err.value)
