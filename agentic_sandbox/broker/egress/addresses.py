"""Which addresses the proxy never connects to unless a rule names them: the classification.

Everything is decided by the standard library's `ipaddress` plus the few ranges it does not
name. An IPv4-mapped or NAT64/6to4-embedded IPv6 address is classified as the IPv4 address it
carries (a guest must not reach 127.0.0.1 as `::ffff:127.0.0.1`).
"""

from __future__ import annotations

import ipaddress

from agentic_sandbox.provision.egress_rules import IPAddress

METADATA = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))
CGNAT = ipaddress.ip_network("100.64.0.0/10")
ULA = ipaddress.ip_network("fc00::/7")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
RFC1918 = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))

# the refused classes, by the reason a refusal names
CLASSES = (
    "metadata",
    "unspecified",
    "loopback",
    "link-local",
    "multicast",
    "private",
    "ula",
    "cgnat",
    "reserved",
)


def classify(address: IPAddress) -> str | None:
    """The refused class of `address` (one of `CLASSES`), or None for a public address."""
    if address in METADATA:
        return "metadata"
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return classify(embedded)
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if isinstance(address, ipaddress.IPv4Address) and address in CGNAT:
        return "cgnat"
    if isinstance(address, ipaddress.IPv6Address) and address in ULA:
        return "ula"
    if isinstance(address, ipaddress.IPv4Address) and any(address in n for n in RFC1918):
        return "private"
    # the rest `ipaddress` knows as not global: documentation, benchmarking, 240/4, …
    if address.is_private or address.is_reserved or not address.is_global:
        return "reserved"
    return None
