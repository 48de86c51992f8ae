"""Brokered credentials: the incarnation's CA and its leaves (checked by OpenSSL itself, through
`ssl`), the credential's validation, and one intercepted connection over loopback — the header
set (the guest's own replaced), the upstream verified, everything else a plain tunnel."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import ValidationError

from agentic_sandbox.broker.egress.interception import (
    CA_LIFETIME,
    CAEnded,
    IncarnationCA,
    upstream_context,
)
from agentic_sandbox.broker.egress.limits import InstanceLimits
from agentic_sandbox.broker.egress.proxy import (
    Brokered,
    BrokerUnavailable,
    Outcome,
    ProxyConnection,
    SocketPipe,
)
from agentic_sandbox.broker.egress.resolver import HostsFileResolver
from agentic_sandbox.provision.egress_rules import EgressConfig
from tests.support.egress_service import egress_service
from tests.support.netns import make_cert

INCARNATION = "0b7e3c1e-6a8f-4e5e-9a55-2f3c1d0e9b11"
SECRET = "s3cret-value-9f2c"
NAMES = ("api.example.com", "other.example.com", "10.9.0.2", "up.test")  # brokered ones


# ---- the CA ------------------------------------------------------------------------------------
def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> None:
    """A TLS handshake between two in-memory ends (raises what the client's checks raise)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    cli = client.wrap_bio(c_in, c_out, server_hostname=name)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(20):
        done = 0
        for end, out, peer_in in ((cli, c_out, s_in), (srv, s_out, c_in)):
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            if data := out.read():
                peer_in.write(data)
        if done == 2:
            return
    raise AssertionError("the handshake did not finish")


def _trusting(ca: IncarnationCA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca.certificate_pem.decode())
    return ctx


def test_the_ca_names_its_instance_and_incarnation_and_signs_leaves_only() -> None:
    ca = IncarnationCA("dev-1", INCARNATION, names=NAMES)
    cert = x509.load_pem_x509_certificate(ca.certificate_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "egress CA of dev-1"
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value
    assert ou == f"incarnation {INCARNATION}"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"urn:agentic-sandbox:incarnation:{INCARNATION}"
    ]
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert CA_LIFETIME <= lifetime <= CA_LIFETIME + dt.timedelta(minutes=10)
    assert b"PRIVATE" not in ca.certificate_pem


def test_a_leaf_verifies_for_its_name_only_and_never_outlives_the_ca() -> None:
    ca = IncarnationCA("dev-1", INCARNATION, names=NAMES)
    _handshake(ca.server_context("api.example.com"), _trusting(ca), "api.example.com")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        _handshake(ca.server_context("api.example.com"), _trusting(ca), "other.example.com")
    other = IncarnationCA(
        "dev-1", "another-incarnation", names=NAMES
    )  # same instance, a new incarnation
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ca.server_context("api.example.com"), _trusting(other), "api.example.com")
    leaf = ca.issue("api.example.com")
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert leaf.not_valid_after_utc <= ca.not_after
    late = ca.issue("api.example.com", now=ca.not_after - dt.timedelta(minutes=30))
    assert late.not_valid_after_utc == ca.not_after
    ip_leaf = ca.issue("10.9.0.2")
    ips = ip_leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ips.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.9.0.2")]


def test_the_ca_signs_for_the_brokered_names_only() -> None:
    """Its name constraint (critical) permits the brokered destinations and the names under
    them, nothing else: a leaf its key makes for any other name or address fails OpenSSL's
    verification (what a stolen key would be good for)."""
    ca = IncarnationCA("dev-1", INCARNATION, names=["api.example.com", "10.9.0.2"])
    ext = ca.certificate.extensions.get_extension_for_class(x509.NameConstraints)
    assert ext.critical and ext.value.excluded_subtrees is None
    assert set(ext.value.permitted_subtrees or []) == {
        x509.DNSName("api.example.com"),
        x509.IPAddress(ipaddress.ip_network("10.9.0.2/32")),
    }
    _handshake(ca.server_context("api.example.com"), _trusting(ca), "api.example.com")
    _handshake(ca.server_context("10.9.0.2"), _trusting(ca), "10.9.0.2")
    for name in ("bank.example.org", "example.com", "xapi.example.com", "10.9.0.3", "::1"):
        with pytest.raises(ssl.SSLCertVerificationError, match=r"(?i)name constraint|permitted"):
            _handshake(ca.server_context(name), _trusting(ca), name)
    nothing = IncarnationCA("dev-1", INCARNATION, names=())  # no brokered destination at all
    for name in ("api.example.com", "10.9.0.2"):
        with pytest.raises(ssl.SSLCertVerificationError, match=r"(?i)name constraint|permitted"):
            _handshake(nothing.server_context(name), _trusting(nothing), name)


def test_the_ca_ends_with_its_incarnation() -> None:
    ca = IncarnationCA("dev-1", INCARNATION, names=NAMES)
    ca.server_context("api.example.com")
    assert ca.fresh()
    ca.destroy()
    assert ca.ended and not ca.fresh()
    with pytest.raises(CAEnded):
        ca.server_context("api.example.com")
    near_end = IncarnationCA(
        "dev-1", INCARNATION, names=NAMES, now=dt.datetime.now(dt.UTC) - CA_LIFETIME
    )
    assert not near_end.fresh()  # a new one is due (made at the next registration)


# ---- the credential ------------------------------------------------------------------------------
def test_a_credential_names_exact_destinations_a_header_and_a_format() -> None:
    cfg = EgressConfig.model_validate(
        {
            "credentials": [
                {"secret": "TOKEN", "destinations": ["API.Example.com.:443"]},
                {
                    "secret": "OTHER",
                    "destinations": ["10.9.0.2:8443"],
                    "header": "X-Api-Key",
                    "format": "{value}",
                },
            ]
        }
    )
    first = cfg.credential_for("api.example.com", 443)
    assert first is not None and first.destinations == ("api.example.com:443",)
    assert first.header_value("abc") == "Bearer abc"
    assert cfg.credential_for("api.example.com", 8443) is None
    assert cfg.credential_for("www.example.com", 443) is None
    second = cfg.credential_for("10.9.0.2", 8443)
    assert second is not None and second.header_value("k") == "k"
    bad = {
        "destinations": {"secret": "T", "destinations": ["*.example.com:443"]},
        "header": {"secret": "T", "destinations": ["a.test:443"], "header": "Host"},
        "format": {"secret": "T", "destinations": ["a.test:443"], "format": "Bearer {x}"},
        "secret": {"secret": "no spaces", "destinations": ["a.test:443"]},
    }
    for field, cred in bad.items():
        with pytest.raises(ValidationError) as err:
            EgressConfig.model_validate({"credentials": [cred]})
        assert err.value.errors()[0]["loc"][:3] == ("credentials", 0, field), field
    with pytest.raises(ValidationError, match="two credentials"):
        EgressConfig.model_validate(
            {
                "credentials": [
                    {"secret": "A", "destinations": ["a.test:443"]},
                    {"secret": "B", "destinations": ["A.test:443"]},
                ]
            }
        )


# ---- one intercepted connection ------------------------------------------------------------------
class Upstream:
    def __init__(self, port: int, ca: Path) -> None:
        self.port = port
        self.ca = ca
        self.seen: list[dict[str, str]] = []


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[Upstream]:
    ca, cert, key = make_cert(tmp_path, "up.test")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    found: list[dict[str, str]] = []

    async def hello(request: web.Request) -> web.Response:
        found.append(dict(request.headers))
        return web.Response(text=f"auth={request.headers.get('Authorization', '-')}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    up = Upstream(site._server.sockets[0].getsockname()[1], ca)  # type: ignore[union-attr]
    up.seen = found
    yield up
    await runner.cleanup()


class Interceptor:
    """A proxy on loopback whose `broker` serves the `up.test` destination as configured."""

    def __init__(self, tmp: Path, upstream: Upstream, *, trust_upstream: bool = True) -> None:
        self.hosts = tmp / "hosts"
        self.hosts.write_text("127.0.0.1 up.test plain.test\n")
        self.up = upstream
        self.ca = IncarnationCA("dev-1", INCARNATION, names=NAMES)
        self.upstream_ctx = upstream_context(upstream.ca if trust_upstream else None)
        port = upstream.port
        self.config = EgressConfig.model_validate(
            {
                "allow": [f"up.test:{port}", f"plain.test:{port}", f"127.0.0.1:{port}"],
                "credentials": [{"secret": "TOKEN", "destinations": [f"up.test:{port}"]}],
            }
        )
        self.value: str | None = SECRET
        self.outcomes: list[Outcome] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def broker(self, host: str, port: int) -> Brokered | None:
        cred = self.config.credential_for(host, port)
        if cred is None:
            return None
        if self.value is None:
            raise BrokerUnavailable("credential-unavailable", "no such secret")
        return Brokered(
            name=cred.secret,
            header=cred.header.lower().encode(),
            value=cred.header_value(self.value).encode(),
            guest_context=self.ca.server_context(host),
            upstream_context=self.upstream_ctx,
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ProxyConnection(
            SocketPipe(reader, writer),
            config=lambda: self.config,
            resolver=HostsFileResolver(self.hosts),
            limits=InstanceLimits(8, 0),
            broker=self.broker,
        )
        self.outcomes.append(await conn.run())

    async def __aenter__(self) -> Interceptor:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def outcome(self) -> Outcome:
        async with asyncio.timeout(10):
            while not self.outcomes:
                await asyncio.sleep(0.01)
        return self.outcomes[-1]

    async def get(
        self, host: str, trust: ssl.SSLContext, headers: str = "", *, tls_name: str = ""
    ) -> tuple[bytes, bytes, x509.Certificate | None]:
        """CONNECT, then (on a 200) TLS trusting `trust` (checking `tls_name`, default `host`)
        and one GET: (CONNECT answer head, the answer inside, the certificate shown)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            async with asyncio.timeout(15):
                target = f"{host}:{self.up.port}"
                writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    return head + await reader.read(), b"", None
                await writer.start_tls(trust, server_hostname=tls_name or host)
                shown = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                get = f"GET /x HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n"
                writer.write(get.encode())
                answer = await reader.read()
                return head, answer, x509.load_der_x509_certificate(shown)
        finally:
            writer.close()


async def test_the_header_is_set_for_a_brokered_destination(
    tmp_path: Path, upstream: Upstream
) -> None:
    async with Interceptor(tmp_path, upstream) as proxy:
        head, answer, shown = await proxy.get(
            "up.test", _trusting(proxy.ca), "Authorization: Bearer the-guests-own\r\n"
        )
        assert head.startswith(b"HTTP/1.1 200")
        assert answer.startswith(b"HTTP/1.1 200") and f"auth=Bearer {SECRET}".encode() in answer
        assert shown is not None and shown.issuer == proxy.ca.certificate.subject
        seen = upstream.seen[-1]
        assert seen["Authorization"] == f"Bearer {SECRET}"
        assert "the-guests-own" not in str(seen)
        assert seen["Host"] == f"up.test:{upstream.port}"
        out = await proxy.outcome()
        assert (out.verdict, out.kind, out.status, out.credential) == (
            "allowed",
            "connect",
            200,
            "TOKEN",
        )
        assert SECRET not in repr(out)


async def test_other_destinations_are_never_intercepted(tmp_path: Path, upstream: Upstream) -> None:
    async with Interceptor(tmp_path, upstream) as proxy:
        real = ssl.create_default_context(cafile=str(upstream.ca))
        # the upstream's own certificate (it names up.test) reaches the client untouched
        head, answer, shown = await proxy.get(
            "plain.test", real, "Authorization: mine\r\n", tls_name="up.test"
        )
        assert head.startswith(b"HTTP/1.1 200") and b"auth=mine" in answer
        assert shown is not None and shown.issuer != proxy.ca.certificate.subject
        out = await proxy.outcome()
        assert (out.verdict, out.credential) == ("allowed", "")
        with pytest.raises(ssl.SSLCertVerificationError):  # the incarnation's CA is not in it
            await proxy.get("plain.test", _trusting(proxy.ca), tls_name="up.test")


async def test_an_upstream_certificate_that_does_not_verify_is_refused(
    tmp_path: Path, upstream: Upstream
) -> None:
    async with Interceptor(tmp_path, upstream, trust_upstream=False) as proxy:
        head, _, _ = await proxy.get("up.test", _trusting(proxy.ca))
        assert head.startswith(b"HTTP/1.1 502")
        assert b"x-egress-reason: upstream-certificate" in head.lower()
        assert b"does not verify" in head
        out = await proxy.outcome()
        assert (out.verdict, out.reason, out.credential) == ("failed", "upstream-certificate", "")
        assert not upstream.seen  # no request reached it


async def test_a_missing_secret_or_an_unusable_value_is_refused(
    tmp_path: Path, upstream: Upstream
) -> None:
    async with Interceptor(tmp_path, upstream) as proxy:
        proxy.value = None
        head, _, _ = await proxy.get("up.test", _trusting(proxy.ca))
        assert head.startswith(b"HTTP/1.1 502") and b"credential-unavailable" in head
        proxy.value = "line\r\nX-Evil: 1"
        head, answer, _ = await proxy.get("up.test", _trusting(proxy.ca))
        assert head.startswith(b"HTTP/1.1 200")
        assert answer.startswith(b"HTTP/1.1 502") and b"credential-unusable" in answer
        assert b"X-Evil" not in answer and not upstream.seen


async def test_a_guest_that_does_not_trust_the_ca_is_recorded(
    tmp_path: Path, upstream: Upstream
) -> None:
    async with Interceptor(tmp_path, upstream) as proxy:
        with pytest.raises(ssl.SSLCertVerificationError):
            await proxy.get("up.test", ssl.create_default_context())
        out = await proxy.outcome()
        assert (out.verdict, out.reason, out.credential) == ("failed", "guest-tls-failed", "")
        assert not upstream.seen


# ---- a new CA when the brokered destinations change ----------------------------------------------
def test_a_change_of_the_brokered_destinations_makes_a_new_ca(tmp_path: Path) -> None:
    egress, _ = egress_service(tmp_path)
    told: list[tuple[str, str]] = []
    egress.on_new_ca = lambda iid, inc: told.append((iid, inc))

    def config(*dests: str, secret: str = "TOKEN") -> EgressConfig:
        creds = [{"secret": secret, "destinations": list(dests)}] if dests else []
        return EgressConfig.model_validate({"credentials": creds})

    egress.replace("dev-1", INCARNATION, "allowlist", config("api.example.com:443"))
    assert told == []  # no CA yet: the first registration makes it
    ca = egress.ca_for("dev-1", INCARNATION, names=frozenset({"api.example.com"}))
    egress.replace("dev-1", INCARNATION, "allowlist", config("API.example.com.:443", secret="B"))
    assert told == [] and not ca.ended  # same destinations (another secret): the same CA
    egress.replace(
        "dev-1", INCARNATION, "allowlist", config("api.example.com:443", "new.test:8443")
    )
    assert told == [("dev-1", INCARNATION)] and ca.ended
    new = egress.ca_for("dev-1", INCARNATION, names=frozenset({"api.example.com", "new.test"}))
    assert new is not ca and new.names == {"api.example.com", "new.test"}
    _handshake(new.server_context("new.test"), _trusting(new), "new.test")
    egress.replace("dev-1", INCARNATION, "isolated", config("api.example.com:443"))
    assert len(told) == 2  # not an allowlist any more: nothing is brokered, a CA for nothing
    assert egress.ca_for("dev-1", INCARNATION, names=frozenset()).names == frozenset()
