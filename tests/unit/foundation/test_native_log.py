"""Native stderr lines (gRPC's C core through abseil, or anything else) as log records."""

from __future__ import annotations

import logging

from agentic_sandbox.broker.observability.native_log import record_for


def test_an_abseil_line_becomes_a_grpc_record_at_its_severity() -> None:
    line = (
        "I1201 10:04:33.469489   17583 ssl_transport_security.cc:2563] Handshake failed with "
        "error SSL_ERROR_SSL: error:1000009c:SSL routines:OPENSSL_internal:HTTP_REQUEST: "
        "Invalid certificate verification context"
    )
    name, level, message, extra = record_for(line)
    assert (name, level) == ("grpc.core", logging.INFO)
    assert message.startswith("Handshake failed with error SSL_ERROR_SSL")
    assert extra == {"source": "ssl_transport_security.cc:2563"}


def test_the_peer_is_named_when_the_line_has_it() -> None:
    for peer in ("ipv4:127.0.0.1:50412", "ipv6:%5B::1%5D:50412", "ipv6:[::1]:443"):
        line = (
            f"E1201 10:04:35.000001   17590 chttp2_server.cc:189] Handshake failed: peer {peer}, x"
        )
        name, level, _, extra = record_for(line)
        assert (name, level, extra["peer"]) == ("grpc.core", logging.ERROR, peer)
        assert extra["source"] == "chttp2_server.cc:189"


def test_any_other_line_is_a_warning_of_its_own() -> None:
    assert record_for("libvirt: QEMU Driver error : Domain not found") == (
        "stderr",
        logging.WARNING,
        "libvirt: QEMU Driver error : Domain not found",
        {},
    )
