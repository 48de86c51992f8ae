"""Egress allowlist rules: what an `allowlist` instance may connect to through the host's proxy.

A rule names a destination and a port, and optionally the HTTP methods allowed there (plain
HTTP only: the proxy cannot see the method inside a `CONNECT` tunnel, so a rule with methods
never allows a `CONNECT`):

    api.example.com:443            the name exactly
    *.pypi.org:443                 any name under pypi.org (not pypi.org itself)
    10.9.0.2:8080                  an address, named explicitly (the only way a private,
    [fd00::2]:80                   loopback or metadata address is ever allowed)
    deb.debian.org:80:GET,HEAD     plain HTTP, these methods only

Host names are normalised before they are compared, in rules and in requests alike: IDNA 2008
(UTS 46 mapping: case folded, a Unicode name becomes its `xn--` A-label form), one trailing dot
dropped. A name that does not survive that (empty labels, a label over 63 octets, a name over
253, characters no host name has) is refused with the reason.

The same text form is what `provision-vm.sh --allow` takes; loadouts and the admin API take the
text form or `{host, port, methods}`.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

import idna
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

MAX_RULES = 256
METHOD_RE = re.compile(r"^[A-Z]{1,16}$")
_LABEL_RE = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class RuleError(ValueError):
    """A rule or a destination name that cannot be used (the message says why)."""


def normalise_host(host: str) -> str:
    """The canonical form of a host name (A-labels, lower case, no trailing dot) or of an
    address literal (`ipaddress`'s compressed form, without brackets). Raises `RuleError`."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    address = parse_address(text)
    if address is not None:
        return address.compressed
    if text.endswith("."):
        text = text[:-1]
    if not text:
        raise RuleError("an empty host name")
    if len(text) > 253:
        raise RuleError("a host name over 253 characters")
    try:
        ascii_name = idna.encode(text, uts46=True, transitional=False).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:
        # underscores (SRV-style names some registries use) are not IDNA but are DNS
        lowered = text.lower()
        if lowered.isascii() and all(_LABEL_RE.match(p) for p in lowered.split(".")):
            return lowered
        raise RuleError(f"not a host name: {host[:80]!r} ({exc})") from None
    name = ascii_name.lower()
    if len(name) > 253 or not all(_LABEL_RE.match(p) for p in name.split(".")):
        raise RuleError(f"not a host name: {host[:80]!r}")
    return name


def parse_address(text: str) -> IPAddress | None:
    """An IP address literal (no zone ids), or None when `text` is not one."""
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class Rule(BaseModel):
    """One allowed destination."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(
        min_length=1,
        max_length=260,
        description="a host name, `*.suffix` (names under suffix) or an address literal",
    )
    port: int = Field(ge=1, le=65535)
    methods: tuple[Annotated[str, Field(max_length=16)], ...] = Field(
        default=(),
        max_length=16,
        description="plain HTTP methods allowed (empty: any, and CONNECT)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _split(value)
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if value.startswith("*."):
            suffix = normalise_host(value[2:])
            if parse_address(suffix) is not None:
                raise ValueError("a wildcard names a domain, not an address")
            return "*." + suffix
        if "*" in value:
            raise ValueError("a wildcard is `*.suffix` at the start only")
        try:
            return normalise_host(value)
        except RuleError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        upper = tuple(dict.fromkeys(m.strip().upper() for m in value))
        for m in upper:
            if not METHOD_RE.match(m):
                raise ValueError(f"not an HTTP method: {m[:20]!r}")
        return upper

    @property
    def address(self) -> IPAddress | None:
        """The address this rule names explicitly, if it names one."""
        return parse_address(self.host)

    @property
    def text(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        tail = f":{','.join(self.methods)}" if self.methods else ""
        return f"{host}:{self.port}{tail}"

    def matches_host(self, host: str) -> bool:
        """Whether a normalised destination host is this rule's."""
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def allows(self, host: str, port: int, method: str | None) -> bool:
        """Whether this rule allows `method` (None: a CONNECT tunnel) to host:port."""
        if port != self.port or not self.matches_host(host):
            return False
        if not self.methods:
            return True
        return method is not None and method.upper() in self.methods


RuleText = Annotated[
    str,
    StringConstraints(min_length=3, max_length=300),
    Field(
        title="RuleText",
        description="`HOST:PORT[:METHOD,…]`, IPv6 literals in brackets",
        examples=["api.example.com:443", "*.pypi.org:443", "deb.debian.org:80:GET,HEAD"],
    ),
]


def _as_given(value: Any) -> Any:
    return value  # `Rule` itself reads the text form; this only documents that it may


RuleInput = Annotated[Rule, BeforeValidator(_as_given, json_schema_input_type=RuleText | Rule)]
"""A rule as a caller may give it: its text form or `{host, port, methods}` (the OpenAPI
document says both, `anyOf`); always a `Rule` once read."""


def _split(text: str) -> dict[str, Any]:
    """`HOST:PORT[:METHODS]` with `[v6]` for IPv6 literals."""
    s = text.strip()
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            raise ValueError(f"{text[:80]!r}: an unclosed `[`")
        host, rest = s[: end + 1], s[end + 1 :]
        if not rest.startswith(":"):
            raise ValueError(f"{text[:80]!r}: expected HOST:PORT")
        parts = rest[1:].split(":")
    else:
        pieces = s.split(":")
        if len(pieces) < 2:
            raise ValueError(f"{text[:80]!r}: expected HOST:PORT")
        host, parts = pieces[0], pieces[1:]
    if len(parts) > 2 or not parts[0].isdigit():
        raise ValueError(f"{text[:80]!r}: expected HOST:PORT[:METHOD,…] (IPv6 in brackets)")
    out: dict[str, Any] = {"host": host, "port": int(parts[0])}
    if len(parts) == 2:
        out["methods"] = tuple(m.strip().upper() for m in parts[1].split(",") if m.strip())
    return out


def parse_rule(text: str) -> Rule:
    """A rule from its text form; raises `RuleError` naming what is wrong."""
    try:
        return Rule.model_validate(text)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise RuleError(_first_error(exc)) from None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return str(first.get("msg", exc)).removeprefix("Value error, ")
    return str(exc)


class EgressLimits(BaseModel):
    """Per-instance limits of the proxy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_connections: int = Field(default=32, ge=1, le=4096, description="at once")
    bandwidth_bytes_per_second: int = Field(
        default=0, ge=0, le=10 * 1024**3, description="each way, all connections (0: no limit)"
    )


MAX_CREDENTIALS = 32
SECRET_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$"
_TOKEN_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")  # an HTTP header name (RFC 9110)
# headers the proxy itself owns (framing, routing, hop-by-hop): never a credential's
RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)
VALUE_PLACEHOLDER = "{value}"


class BrokeredCredential(BaseModel):
    """A secret the proxy adds as a header to the requests for its destinations (the guest
    never holds the value: the proxy terminates TLS for those destinations only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: str = Field(
        pattern=SECRET_NAME_PATTERN,
        description="the name of a secret of the instance's owner (its value is never shown)",
    )
    destinations: tuple[Annotated[str, Field(min_length=3, max_length=300)], ...] = Field(
        min_length=1,
        max_length=16,
        description="`HOST:PORT` exactly (no wildcard, no methods); TLS (CONNECT) only",
        examples=[["api.example.com:443"]],
    )
    header: str = Field(default="Authorization", description="the header set (replaced)")
    format: str = Field(
        default="Bearer {value}",
        min_length=len(VALUE_PLACEHOLDER),
        max_length=256,
        description="the header's value, `{value}` standing for the secret's (once)",
    )

    @field_validator("destinations")
    @classmethod
    def _destinations(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        for text in value:
            if "*" in text:
                raise ValueError(f"{text[:80]!r}: a credential names its destinations exactly")
            rule = parse_rule(text)
            if rule.methods:
                raise ValueError(f"{text[:80]!r}: a credential's destination has no methods")
            if rule.text not in out:
                out.append(rule.text)
        return tuple(out)

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not _TOKEN_RE.match(value):
            raise ValueError("not an HTTP header name")
        if value.lower() in RESERVED_HEADERS:
            raise ValueError(f"{value!r} is the proxy's own header")
        return value

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value.count(VALUE_PLACEHOLDER) != 1:
            raise ValueError("must hold `{value}` exactly once")
        rest = value.replace(VALUE_PLACEHOLDER, "")
        if "{" in rest or "}" in rest:
            raise ValueError("no braces besides `{value}`")
        if not all(" " <= c <= "~" for c in rest):
            raise ValueError("printable ASCII only (no control characters)")
        return value

    def serves(self, host: str, port: int) -> bool:
        """Whether this credential is for the (normalised) destination."""
        return any(_dest_matches(d, host, port) for d in self.destinations)

    def header_value(self, secret_value: str) -> str:
        return self.format.replace(VALUE_PLACEHOLDER, secret_value)


def _dest_matches(dest: str, host: str, port: int) -> bool:
    rule = parse_rule(dest)
    return rule.port == port and rule.host == host


class EgressConfig(BaseModel):
    """An instance's egress allowlist and limits (loadout `egress:`, create request, admin API)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: tuple[RuleInput, ...] = Field(default=(), max_length=MAX_RULES)
    limits: EgressLimits = EgressLimits()
    credentials: tuple[BrokeredCredential, ...] = Field(
        default=(),
        max_length=MAX_CREDENTIALS,
        description="brokered credentials: secrets the proxy adds for named destinations",
    )

    @field_validator("credentials")
    @classmethod
    def _one_per_destination(
        cls, value: tuple[BrokeredCredential, ...]
    ) -> tuple[BrokeredCredential, ...]:
        seen: dict[str, int] = {}
        for i, cred in enumerate(value):
            for dest in cred.destinations:
                if dest in seen:
                    raise ValueError(
                        f"{dest} has two credentials ({seen[dest]} and {i}): one at most"
                    )
                seen[dest] = i
        return value

    def brokered_hosts(self) -> frozenset[str]:
        """The host names and address literals its credentials are for (what the
        incarnation's CA may sign for)."""
        return frozenset(parse_rule(d).host for c in self.credentials for d in c.destinations)

    def credential_for(self, host: str, port: int) -> BrokeredCredential | None:
        """The brokered credential of this destination, if it has one."""
        return next((c for c in self.credentials if c.serves(host, port)), None)

    def decide(self, host: str, port: int, method: str | None) -> Rule | None:
        """The first rule allowing this destination, or None."""
        return next((r for r in self.allow if r.allows(host, port, method)), None)

    def names_address(self, address: IPAddress, port: int) -> bool:
        """Whether a rule names `address` explicitly (on this port)."""
        return any(r.address == address and r.port == port for r in self.allow)
