"""The decision for one destination: the instance's rules, the host's resolver, the classes.

`check` answers a `Decision` with the address to connect to — the one it checked, so a name
whose answer changes between the check and the connect (DNS rebinding) cannot lead elsewhere.
Refused unless a rule allows it:

- a name no rule allows (`not-allowed`), or a method the matching rule does not list
  (`method-not-allowed`; a rule with methods never allows a `CONNECT`);
- a name that does not resolve (`unresolvable`);
- an allowed name all of whose addresses are in a refused class (`address-loopback`,
  `address-private`, `address-metadata` …, see `addresses.CLASSES`) that no rule names
  explicitly on that port: an allowed public name pointed at a private address is the
  rebinding attack, refused. Of a mix, only the acceptable addresses are tried.
- an address literal is allowed only by a rule naming that address.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentic_sandbox.broker.egress.addresses import classify
from agentic_sandbox.broker.egress.resolver import ResolveError, Resolver
from agentic_sandbox.provision.egress_rules import (
    EgressConfig,
    IPAddress,
    Rule,
    RuleError,
    normalise_host,
    parse_address,
)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # "" when allowed; else a short code (not-allowed, address-private, …)
    host: str  # the normalised name (or the request's text when it did not normalise)
    addresses: tuple[IPAddress, ...] = ()  # to try, in order (allowed only)
    rule: Rule | None = None
    detail: str = ""
    resolved: tuple[IPAddress, ...] = ()  # what the name resolved to (for the audit)

    @property
    def address(self) -> str:
        first = self.addresses or self.resolved
        return str(first[0]) if first else ""


def deny(host: str, reason: str, detail: str) -> Decision:
    return Decision(False, reason, host, detail=detail)


async def check(
    config: EgressConfig, host: str, port: int, method: str | None, resolver: Resolver
) -> Decision:
    """Whether `method` (None: CONNECT) to host:port is allowed, and where to connect."""
    try:
        name = normalise_host(host)
    except RuleError as exc:
        return deny(host[:253], "bad-host", str(exc))
    if not 1 <= port <= 65535:
        return deny(name, "bad-port", f"port {port} is out of range")
    rule = config.decide(name, port, method)
    if rule is None:
        by_name = config.decide(name, port, "GET") or next(
            (r for r in config.allow if r.matches_host(name) and r.port == port), None
        )
        if by_name is not None:
            what = "CONNECT" if method is None else method
            return deny(name, "method-not-allowed", f"{what} is not allowed to {name}:{port}")
        return deny(name, "not-allowed", f"no rule allows {name}:{port}")
    literal = parse_address(name)
    if literal is not None:  # the rule names this address itself
        return Decision(True, "", name, (literal,), rule)
    try:
        found = await resolver.resolve(name, port)
    except ResolveError as exc:
        return deny(name, "unresolvable", str(exc))
    usable: list[IPAddress] = []
    refused: list[str] = []
    for address in found:
        cls = classify(address)
        if cls is None or config.names_address(address, port):
            usable.append(address)
        else:
            refused.append(f"{address} ({cls})")
    if not usable:
        first = classify(found[0]) or "refused"
        return Decision(
            False,
            f"address-{first}",
            name,
            rule=rule,
            resolved=tuple(found),
            detail=f"{name} resolves to {', '.join(refused)}, which no rule names",
        )
    return Decision(True, "", name, tuple(usable), rule, resolved=tuple(found))
