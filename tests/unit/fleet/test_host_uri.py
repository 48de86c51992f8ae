"""Host URIs: libvirt's remote protocol only, nothing that runs a command or skips a check, and
the credential parameters set by the fleet, never by the operator."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from agentic_sandbox.fleet import HostSpec
from agentic_sandbox.fleet.host_uri import HostUriError, connection_uri, parse_host_uri


@pytest.mark.parametrize(
    "uri",
    [
        "qemu:///system",
        "qemu:///session",
        "test:///default",
        "qemu+unix:///system?socket=/run/x/libvirt-sock",
        "qemu+tcp://198.18.0.2/system",
        "qemu+tcp://198.18.0.2:17000/system",
        "qemu+tls://h1.example/system",
        "qemu+tls://[fd00::2]:16514/system",
        "qemu+ssh://root@198.18.0.6/system",
        "qemu+ssh://ops@h2.example:2222/system",
        "qemu+libssh://ops@h2.example/system",
        "qemu+libssh2://ops@h2.example/system",
    ],
)
def test_libvirt_remote_protocol_uris_are_accepted(uri: str) -> None:
    parse_host_uri(uri)
    assert HostSpec(name="h", uri=uri).uri == uri


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("qemu+ext:///system?command=/bin/sh", "transport 'ext'"),
        ("xen+ssh://root@h/system", "unknown driver 'xen'"),
        ("http://h/system", "unknown driver 'http'"),
        ("qemu+tls://h/system?no_verify=1", "no_verify"),
        ("qemu+tls://h/system?no_verify=0", "no_verify"),
        ("qemu+ssh://root@h/system?no_verify=1", "no_verify"),
        ("qemu+ssh://root@h/system?command=/tmp/evil", "'command'"),
        ("qemu+ssh://root@h/system?netcat=/tmp/evil", "'netcat'"),
        ("qemu+ssh://root@h/system?socket=/tmp/s%3Btouch%20x", "'socket'"),
        ("qemu+ssh://root@h/system?proxy=netcat", "'proxy'"),
        ("qemu+tcp://h/system?socket=/x", "'socket'"),
        ("qemu+tls://h/system?pkipath=/etc", "set by the server"),
        ("qemu+ssh://root@h/system?keyfile=/root/.ssh/id", "set by the server"),
        ("qemu+ssh://root@h/system?known_hosts_verify=ignore", "set by the server"),
        ("qemu+tls://h/system?name=qemu:///system", "unknown parameter 'name'"),
        ("qemu+unix:///system?socket=/a&socket=/b", "given twice"),
        ("qemu+tls:///system", "needs a host"),
        ("qemu://h/system", "network transport"),
        ("qemu+tls://u@h/system", "user name"),
        ("qemu+ssh://u:pw@h/system", "password"),
        ("qemu+tcp://h:99999/system", "not a valid URI"),
        ("qemu+tcp://h/system#x", "fragment"),
        ("qemu+tcp://h/sys tem", "whitespace"),
        ("qemu+tcp://h/system\n", "whitespace"),
    ],
)
def test_uris_that_run_commands_or_skip_checks_are_refused_by_name(uri: str, why: str) -> None:
    with pytest.raises(HostUriError, match=why):
        parse_host_uri(uri)
    with pytest.raises(ValidationError, match=why):
        HostSpec(name="h", uri=uri)


def test_a_tls_host_opens_with_its_pki_directory() -> None:
    spec = HostSpec(name="h", uri="qemu+tls://198.18.0.2/system", tls_pki_dir="/srv/pki/h")
    assert spec.connection_uri == "qemu+tls://198.18.0.2/system?pkipath=/srv/pki/h"
    assert HostSpec(name="h", uri="qemu+tls://h/system").connection_uri == "qemu+tls://h/system"


def test_an_ssh_host_opens_over_libssh2_with_its_key_and_a_pinned_host_key(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    spec = HostSpec(
        name="h",
        uri="qemu+ssh://ops@198.18.0.6:2222/system",
        ssh_key_file=str(tmp_path / "id"),
        ssh_known_hosts=str(known),
    )
    first = urlsplit(spec.connection_uri)
    assert (first.scheme, first.netloc, first.path) == (
        "qemu+libssh2",
        "ops@198.18.0.6:2222",
        "/system",
    )
    q = parse_qs(first.query)
    assert q == {
        "sshauth": ["privkey"],
        "keyfile": [str(tmp_path / "id")],
        "known_hosts": [str(known)],
        "known_hosts_verify": ["auto"],  # nothing known yet: trust on first use
    }
    known.write_text("[198.18.0.6]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI0\n")
    q = parse_qs(urlsplit(spec.connection_uri).query)
    assert q["known_hosts_verify"] == ["normal"]  # recorded (or given): pinned from now on
    assert "no_verify" not in spec.connection_uri


@pytest.mark.parametrize(
    ("uri", "fields", "why"),
    [
        ("qemu+tcp://h/system", {"tls_pki_dir": "/p"}, "only for qemu\\+tls"),
        (
            "qemu+tls://h/system",
            {"ssh_key_file": "/k", "ssh_known_hosts": "/kh"},
            "only for qemu\\+ssh",
        ),
        ("qemu+ssh://u@h/system", {"ssh_key_file": "/k"}, "known_hosts"),
        ("qemu+tls://h/system", {"tls_pki_dir": "relative"}, "absolute"),
    ],
)
def test_credentials_must_fit_the_transport(uri: str, fields: dict[str, str], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        HostSpec(name="h", uri=uri, **fields)


def test_a_path_with_query_characters_stays_one_parameter() -> None:
    uri = connection_uri("qemu+tls://h/system", tls_pki_dir="/srv/a&b=c d")
    assert parse_qs(urlsplit(uri).query) == {"pkipath": ["/srv/a&b=c d"]}
