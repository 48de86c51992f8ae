"""The decision: rules, then the host's resolver, then the address classes (rebinding)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_sandbox.broker.egress.policy import check
from agentic_sandbox.broker.egress.resolver import HostsFileResolver
from agentic_sandbox.provision.egress_rules import EgressConfig


@pytest.fixture
def resolver(tmp_path: Path) -> HostsFileResolver:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# test names\n"
        "93.184.216.34 public.example\n"
        "10.9.0.2 rebound.example private.example\n"
        "127.0.0.1 loop.example\n"
        "169.254.169.254 meta.example\n"
        "10.9.0.3 mixed.example\n"
        "93.184.216.35 mixed.example\n"
        "93.184.216.36 xn--bcher-kva.example\n"
    )
    return HostsFileResolver(hosts)


def cfg(*rules: str) -> EgressConfig:
    return EgressConfig.model_validate({"allow": list(rules)})


async def test_allowed_public_name(resolver: HostsFileResolver) -> None:
    d = await check(cfg("public.example:443"), "PUBLIC.example.", 443, None, resolver)
    assert (d.allowed, d.host, d.address) == (True, "public.example", "93.184.216.34")


async def test_idn_names_match_their_a_labels(resolver: HostsFileResolver) -> None:
    d = await check(cfg("bücher.example:443"), "xn--bcher-kva.example", 443, None, resolver)
    assert d.allowed and d.address == "93.184.216.36"
    d = await check(cfg("xn--bcher-kva.example:443"), "BÜCHER.example", 443, None, resolver)
    assert d.allowed


async def test_not_listed_is_refused(resolver: HostsFileResolver) -> None:
    d = await check(cfg("public.example:443"), "public.example", 80, None, resolver)
    assert (d.allowed, d.reason) == (False, "not-allowed")
    d = await check(cfg("public.example:443"), "other.example", 443, None, resolver)
    assert (d.allowed, d.reason) == (False, "not-allowed")


async def test_methods(resolver: HostsFileResolver) -> None:
    rules = cfg("public.example:80:GET")
    assert (await check(rules, "public.example", 80, "GET", resolver)).allowed
    d = await check(rules, "public.example", 80, "POST", resolver)
    assert (d.allowed, d.reason) == (False, "method-not-allowed")
    d = await check(rules, "public.example", 80, None, resolver)
    assert (d.allowed, d.reason) == (False, "method-not-allowed")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("rebound.example", "address-private"),
        ("loop.example", "address-loopback"),
        ("meta.example", "address-metadata"),
    ],
)
async def test_allowed_name_resolving_to_a_refused_address_is_refused(
    resolver: HostsFileResolver, name: str, reason: str
) -> None:
    d = await check(cfg(f"{name}:443"), name, 443, None, resolver)
    assert (d.allowed, d.reason) == (False, reason)
    assert d.address  # the audit names what it resolved to
    assert "which no rule names" in d.detail


async def test_explicitly_named_private_address_is_allowed(resolver: HostsFileResolver) -> None:
    rules = cfg("private.example:8080", "10.9.0.2:8080")
    d = await check(rules, "private.example", 8080, None, resolver)
    assert (d.allowed, d.address) == (True, "10.9.0.2")
    # named on another port only: still refused
    d = await check(
        cfg("private.example:443", "10.9.0.2:8080"), "private.example", 443, None, resolver
    )
    assert (d.allowed, d.reason) == (False, "address-private")


async def test_a_mix_uses_only_the_acceptable_addresses(resolver: HostsFileResolver) -> None:
    d = await check(cfg("mixed.example:443"), "mixed.example", 443, None, resolver)
    assert d.allowed
    assert [str(a) for a in d.addresses] == ["93.184.216.35"]


async def test_address_literals_need_a_rule_naming_them(resolver: HostsFileResolver) -> None:
    d = await check(cfg("public.example:80"), "169.254.169.254", 80, "GET", resolver)
    assert (d.allowed, d.reason) == (False, "not-allowed")
    d = await check(cfg("*.example:80"), "127.0.0.1", 80, "GET", resolver)
    assert not d.allowed
    d = await check(cfg("[::1]:80"), "[0:0::1]", 80, "GET", resolver)
    assert (d.allowed, d.address) == (True, "::1")


async def test_unresolvable_and_bad_names(resolver: HostsFileResolver) -> None:
    d = await check(cfg("*.example:443"), "nowhere.example", 443, None, resolver)
    assert (d.allowed, d.reason) == (False, "unresolvable")
    d = await check(cfg("*.example:443"), "bad..example", 443, None, resolver)
    assert (d.allowed, d.reason) == (False, "bad-host")


async def test_the_hosts_file_is_read_at_each_lookup(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("93.184.216.34 flip.example\n")
    resolver = HostsFileResolver(hosts)
    rules = cfg("flip.example:443")
    assert (await check(rules, "flip.example", 443, None, resolver)).allowed
    hosts.write_text("10.0.0.7 flip.example\n")  # the name now rebinds to a private address
    d = await check(rules, "flip.example", 443, None, resolver)
    assert (d.allowed, d.reason) == (False, "address-private")
