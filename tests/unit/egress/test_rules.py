"""Allowlist rules: the text form, normalisation (IDN, case, trailing dot), wildcards, ports
and methods."""

from __future__ import annotations

import pytest

from agentic_sandbox.provision import LoadoutCatalog, LoadoutError
from agentic_sandbox.provision.egress_rules import (
    EgressConfig,
    Rule,
    RuleError,
    normalise_host,
    parse_rule,
)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("Example.COM", "example.com"),
        ("example.com.", "example.com"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example.", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("[FD00::0002]", "fd00::2"),
        ("010.1.2.3".replace("010", "10"), "10.1.2.3"),
        ("_sip.example.org", "_sip.example.org"),
    ],
)
def test_names_are_normalised(given: str, canonical: str) -> None:
    assert normalise_host(given) == canonical


@pytest.mark.parametrize("bad", ["", ".", "a..b", "-a.example", "a" * 64 + ".example", "a b"])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(RuleError):
        normalise_host(bad)


def test_text_form_round_trips() -> None:
    for text in (
        "api.example.com:443",
        "*.pypi.org:443",
        "[fd00::2]:80",
        "deb.debian.org:80:GET,HEAD",
    ):
        assert parse_rule(text).text == text
    assert parse_rule("API.Example.com.:443").text == "api.example.com:443"
    assert parse_rule("h:80:get,head,get").methods == ("GET", "HEAD")


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("example.com", "HOST:PORT"),
        ("example.com:0", "greater than or equal to 1"),
        ("example.com:70000", "less than or equal to 65535"),
        ("example.com:https", "HOST:PORT"),
        ("ex*mple.com:443", "wildcard"),
        ("*.10.0.0.1:443", "domain"),
        ("[fd00::2:80", "unclosed"),
        ("fd00::2:80", "HOST:PORT"),
    ],
)
def test_bad_rules_say_why(bad: str, says: str) -> None:
    with pytest.raises(RuleError, match=says):
        parse_rule(bad)


def test_exact_and_wildcard_matching() -> None:
    exact = parse_rule("api.example.com:443")
    assert exact.allows("api.example.com", 443, None)
    assert not exact.allows("api.example.com", 80, None)
    assert not exact.allows("x.api.example.com", 443, None)
    wild = parse_rule("*.example.com:443")
    assert wild.allows("a.example.com", 443, None)
    assert wild.allows("a.b.example.com", 443, "GET")
    assert not wild.allows("example.com", 443, None)  # the suffix itself is not under it
    assert not wild.allows("badexample.com", 443, None)
    assert not wild.allows("example.com.evil.net", 443, None)


def test_methods_apply_to_plain_http_and_never_allow_connect() -> None:
    rule = parse_rule("deb.example:80:GET,HEAD")
    assert rule.allows("deb.example", 80, "GET")
    assert rule.allows("deb.example", 80, "head")
    assert not rule.allows("deb.example", 80, "POST")
    assert not rule.allows("deb.example", 80, None)


def test_config_accepts_text_and_objects() -> None:
    cfg = EgressConfig.model_validate(
        {"allow": ["a.example:443", {"host": "B.example.", "port": 80, "methods": ["get"]}]}
    )
    assert [r.text for r in cfg.allow] == ["a.example:443", "b.example:80:GET"]
    assert cfg.decide("b.example", 80, "GET") == Rule(host="b.example", port=80, methods=("GET",))
    assert cfg.decide("b.example", 80, "PUT") is None


def test_loadouts_carry_the_allowlist_and_merge_it(tmp_path) -> None:
    (tmp_path / "base.yaml").write_text(
        "name: base\nnetwork: allowlist\negress:\n  allow: ['a.example:443']\n"
    )
    (tmp_path / "child.yaml").write_text(
        "name: child\nextends: base\negress:\n  allow: ['*.b.example:443']\n"
        "  limits: {max_connections: 4}\n"
    )
    catalog = LoadoutCatalog([tmp_path])
    child = catalog.resolve("child")
    assert child.network == "allowlist"
    assert [r.text for r in child.egress.allow] == ["a.example:443", "*.b.example:443"]
    assert child.egress.limits.max_connections == 4
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "bad.yaml").write_text("name: bad\nnetwork: allowlist\negress:\n  allow: ['x']\n")
    with pytest.raises(LoadoutError, match=r"egress\.allow\.0: .*'x': expected HOST:PORT"):
        LoadoutCatalog([bad]).resolve("bad")
