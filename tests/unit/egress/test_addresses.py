"""Address classification: what the proxy refuses unless a rule names the address."""

from __future__ import annotations

import ipaddress

import pytest

from agentic_sandbox.broker.egress.addresses import classify


@pytest.mark.parametrize(
    ("address", "cls"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "ula"),
        ("100.64.0.1", "cgnat"),
        ("100.127.255.254", "cgnat"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "metadata"),
        ("::ffff:10.0.0.1", "private"),
        ("64:ff9b::a00:1", "private"),
        ("2002:7f00:1::", "loopback"),
        ("240.0.0.1", "reserved"),
        ("192.0.2.1", "reserved"),
        ("8.8.8.8", None),
        ("1.1.1.1", None),
        ("2606:4700::1111", None),
        ("100.128.0.1", None),
    ],
)
def test_classes(address: str, cls: str | None) -> None:
    assert classify(ipaddress.ip_address(address)) == cls
