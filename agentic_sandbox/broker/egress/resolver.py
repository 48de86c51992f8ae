"""Name resolution on the host, for the proxy (the guest has no DNS of its own).

`SystemResolver` asks the host's resolver (`getaddrinfo` in the loop's executor).
`HostsFileResolver` answers from a hosts(5)-format file only — for tests and for operators
who pin names — and never asks DNS: a name the file does not list does not resolve. The
proxy connects to the very address it checked (never resolving twice), which is what makes a
name that changes its answer between the check and the connect (DNS rebinding) harmless.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Protocol

from agentic_sandbox.provision.egress_rules import (
    IPAddress,
    RuleError,
    normalise_host,
    parse_address,
)

MAX_ADDRESSES = 16


class ResolveError(Exception):
    """The name did not resolve (the message says why)."""


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """The addresses of a normalised host name, in the order to try; raises ResolveError."""
        ...


class SystemResolver:
    def __init__(self, timeout: float = 5.0) -> None:
        self._timeout = timeout

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise ResolveError(f"resolving {host} took over {self._timeout:g} s") from None
        except OSError as exc:
            raise ResolveError(f"{host} does not resolve: {exc.strerror or exc}") from None
        out: list[IPAddress] = []
        for _family, _type, _proto, _name, sockaddr in infos:
            address = parse_address(str(sockaddr[0]))
            if address is not None and address not in out:
                out.append(address)
        if not out:
            raise ResolveError(f"{host} has no address")
        return out[:MAX_ADDRESSES]


class HostsFileResolver:
    """Names from a hosts-format file (`ADDRESS NAME [NAME…]`, `#` comments), read at each
    lookup so a test or an operator can change it while the server runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _table(self) -> dict[str, list[IPAddress]]:
        table: dict[str, list[IPAddress]] = {}
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ResolveError(f"the hosts file {self.path} cannot be read: {exc}") from None
        for line in text.splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) < 2:
                continue
            address = parse_address(fields[0])
            if address is None:
                continue
            for name in fields[1:]:
                try:
                    key = normalise_host(name)
                except RuleError:
                    continue
                table.setdefault(key, []).append(address)
        return table

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        found = self._table().get(host)
        if not found:
            raise ResolveError(f"{host} is not in the hosts file")
        return found[:MAX_ADDRESSES]
