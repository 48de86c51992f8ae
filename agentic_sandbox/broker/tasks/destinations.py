"""Where the server may send requests for a caller: push-notification webhooks.

A caller chooses the URL, so a destination is refused when its host is, or resolves to, an
address that is not public unicast: loopback, private (RFC 1918, IPv6 ULA), link-local (which
holds the cloud metadata address 169.254.169.254), shared (CGNAT 100.64/10, also used for
metadata), multicast, reserved, unspecified, documentation ranges — everything the standard
library's `ipaddress` does not call global. An IPv6 address that carries an IPv4 one
(IPv4-mapped, 6to4, Teredo, NAT64) is judged by that too. The operator's `push_allow_networks` names
networks that are allowed all the same (a receiver on the control host, on a LAN, in tests).

Names are checked at two moments: when a config is set (`check_url`), and at every connection.
For the second, `CheckedResolver` is the HTTP client's resolver: it resolves the name once,
checks every address, and hands the client exactly the addresses it checked — the client
connects to those, so a name that resolves elsewhere by then (DNS rebinding) is checked again
rather than trusted. A name with any refused address is refused as a whole. IP literals skip the
client's resolver, so `check_host` is called for them before each request.

Refusals say only that the destination is not allowed — never which address a name resolved
to, nor whether it resolved at all.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

REFUSED = (
    "the destination is not allowed: push notifications go to public addresses only (an "
    "operator allows others with push_allow_networks)"
)


class DestinationRefused(Exception):
    """A destination the server must not send to (the message is safe to show)."""

    def __init__(self, message: str = REFUSED) -> None:
        super().__init__(message)


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """Networks in CIDR form (a bare address is a network of one); ValueError names the bad
    one."""
    out: list[Network] = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP network (CIDR) or address") from None
    return tuple(out)


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the last 32 bits are IPv4


def _carried_v4(ip: Address) -> ipaddress.IPv4Address | None:
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: Address) -> bool:
    """A globally routable unicast address (and so is any IPv4 address it carries)."""
    if not ip.is_global or ip.is_multicast:
        return False
    carried = _carried_v4(ip)
    return carried is None or is_public(carried)


class DestinationPolicy:
    def __init__(self, allow: Iterable[str] = ()) -> None:
        self.allow = parse_networks(allow)

    def permits(self, ip: Address) -> bool:
        if any(ip.version == net.version and ip in net for net in self.allow):
            return True
        return is_public(ip)

    def check_address(self, text: str) -> None:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            raise DestinationRefused() from None
        if not self.permits(ip):
            raise DestinationRefused()


def literal_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class CheckedResolver(AbstractResolver):
    """Resolves with `inner` (the system resolver by default) and returns the result only
    when every address is one the policy permits; raises `DestinationRefused` otherwise."""

    def __init__(self, policy: DestinationPolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self.inner = inner

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if self.inner is None:
            self.inner = ThreadedResolver()
        try:
            results = await self.inner.resolve(host, port, family)
        except OSError:
            raise DestinationRefused() from None  # said the same way as a refused address
        if not results:
            raise DestinationRefused()
        for result in results:
            self.policy.check_address(result["host"])
        return results

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()

    async def check_host(self, host: str, port: int) -> None:
        """Refuse a host (a name or an IP literal) that is, or resolves to, a refused address."""
        if literal_address(host):
            self.policy.check_address(host)
        else:
            await self.resolve(host, port, socket.AF_UNSPEC)

    async def check_url(self, url: str) -> None:
        parts = urlsplit(url)
        host = parts.hostname or ""
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise DestinationRefused("the url's port is not a number from 0 to 65535") from None
        await self.check_host(host, port)
