"""The ports' edges without a server: the path's port, what the guest is sent (never the
server's credentials), what the caller gets back (never a cookie of ours, always sandboxed),
the upstream target kept raw, and `port-forward`'s `[LOCAL:]REMOTE`."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.ports.proxy import (
    downstream_headers,
    is_websocket,
    upstream_headers,
    upstream_target,
)
from agentic_sandbox.broker.ports.service import check_port
from agentic_sandbox.sandboxctl.exits import CliError
from agentic_sandbox.sandboxctl.ports import parse_ports

BASE = "/api/v2/admin/instances/dev-1/ports/8000"


@pytest.mark.parametrize("raw", ["1", "80", "65535"])
def test_ports_in_range(raw: str) -> None:
    assert check_port(raw) == int(raw)


@pytest.mark.parametrize("raw", ["0", "65536", "-1", "http", "", "0080x", "999999999999"])
def test_other_ports_are_a_422_naming_the_field(raw: str) -> None:
    with pytest.raises(ProblemError) as bad:
        check_port(raw)
    assert bad.value.status == 422 and bad.value.code == "bad-port"
    assert bad.value.errors == [
        {"field": "path.port", "message": "must be 1-65535", "type": "bad-port"}
    ]


def test_the_target_is_the_rest_of_the_raw_path_and_query() -> None:
    req = make_mocked_request("GET", BASE + "/a%2Fb/c?x=%2F&y")
    assert upstream_target(req) == "/a%2Fb/c?x=%2F&y"
    assert upstream_target(make_mocked_request("GET", BASE + "/")) == "/"
    assert upstream_target(make_mocked_request("GET", BASE)) == "/"


def test_the_guest_never_gets_the_servers_credentials() -> None:
    headers = CIMultiDict(
        {
            "Authorization": "Bearer sbt_secret",
            "Cookie": "a=1; sbx_session=sess-secret; b=2",
            "X-CSRF-Token": "csrf-secret",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "dropped",
            "Keep-Alive": "timeout=5",
            "Host": "sandbox.example:8122",
            "Accept": "text/html",
            "X-Forwarded-For": "1.2.3.4",
        }
    )
    req = make_mocked_request("GET", BASE + "/x", headers=headers)
    out = upstream_headers(req, 8000, BASE, websocket=False)
    text = repr(out)
    assert "secret" not in text and "X-Hop" not in text and "timeout=5" not in text
    got = dict((k.lower(), v) for k, v in out)
    assert got["host"] == "localhost:8000" and got["accept"] == "text/html"
    assert got["cookie"] == "a=1; b=2" and got["connection"] == "close"
    assert got["x-forwarded-prefix"] == BASE and got["x-forwarded-for"] != "1.2.3.4"


def test_a_websocket_upgrade_keeps_its_protocols_but_not_the_bearer_one() -> None:
    headers = CIMultiDict(
        {
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Protocol": "bearer.sbt_secret, chat.v2",
        }
    )
    req = make_mocked_request("GET", BASE + "/ws", headers=headers)
    assert is_websocket(req)
    out = upstream_headers(req, 8000, BASE, websocket=True)
    got = dict((k.lower(), v) for k, v in out)
    assert got["sec-websocket-protocol"] == "chat.v2" and "secret" not in repr(out)
    assert got["upgrade"] == "websocket" and got["sec-websocket-key"]
    assert not is_websocket(make_mocked_request("GET", BASE + "/ws"))


def test_the_caller_never_gets_our_cookie_and_every_answer_is_sandboxed() -> None:
    out = downstream_headers(
        [
            (b"Content-Type", b"text/html"),
            (b"Set-Cookie", b"sbx_session=planted; Path=/"),
            (b"Set-Cookie", b"app=1; Path=/"),
            (b"Connection", b"close, X-Hop"),
            (b"X-Hop", b"x"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Content-Security-Policy", b"default-src *"),
        ]
    )
    assert ("Set-Cookie", "app=1; Path=/") in out
    assert not any("planted" in v or n in ("X-Hop", "Transfer-Encoding") for n, v in out)
    csp = [v for n, v in out if n.lower() == "content-security-policy"]
    assert len(csp) == 1 and csp[0].startswith("sandbox ") and "allow-same-origin" not in csp[0]


@pytest.mark.parametrize(
    ("text", "want"),
    [("8000", (8000, 8000)), ("9000:8000", (9000, 8000)), (":8000", (0, 8000)), ("0:22", (0, 22))],
)
def test_local_and_remote_ports(text: str, want: tuple[int, int]) -> None:
    assert parse_ports(text) == want


@pytest.mark.parametrize("text", ["", "x", "0", "70000", "1:2:3", "-1:80", "80:"])
def test_bad_port_pairs_are_usage_errors(text: str) -> None:
    with pytest.raises(CliError):
        parse_ports(text)
