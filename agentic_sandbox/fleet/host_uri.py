"""Host URIs: which libvirt URIs a host may have, and the URI the fleet actually opens.

An operator names a host by a libvirt URI. Only libvirt's own remote protocol is accepted:
``qemu:///system`` (and ``test:///``) locally, ``qemu+unix:///system?socket=PATH`` for another
local daemon, ``qemu+tcp://`` (a test network: the daemon's ``auth_tcp``, none or SASL, is its
own business), ``qemu+tls://`` and ``qemu+ssh://`` (``qemu+libssh2://`` and ``qemu+libssh://``
mean the same here).

Refused, because they would run a command or weaken a check: the ``ext`` transport and the
``command=``, ``netcat=``, ``proxy=`` parameters (programs run locally or on the host), ``socket=``
on anything but ``+unix`` (over ssh it becomes part of a remote shell command),
``no_verify=`` (skips the TLS or host-key check) and any parameter this module does not know.
Also refused are the parameters the fleet sets itself from the host's credentials
(``pkipath``, ``keyfile``, ``known_hosts``, ``known_hosts_verify``, ``sshauth``): the operator
gives the credentials, not the parameters that point at them.

`connection_uri` adds those parameters for the connection:

- ``qemu+tls``: ``pkipath=<tls_pki_dir>``, a directory holding ``cacert.pem``,
  ``clientcert.pem`` and ``clientkey.pem`` (libvirt's names).
- ``qemu+ssh``: opened with libvirt's in-process ``libssh2`` transport (no local ``ssh`` binary,
  no ``~/.ssh/config``; libvirt 9.0's ``libssh`` transport crashes the client in a storage
  stream's finish, so it is not used), ``sshauth=privkey``, ``keyfile=<ssh_key_file>``,
  ``known_hosts=<ssh_known_hosts>`` and ``known_hosts_verify=normal`` when that file has an
  entry; an empty or missing file means trust on first use: ``known_hosts_verify=auto``
  records the key the host shows, and every later connection checks it (``normal``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

DRIVERS = ("qemu", "test")
TRANSPORTS = ("", "unix", "tcp", "tls", "ssh", "libssh", "libssh2")
SSH_TRANSPORTS = ("ssh", "libssh", "libssh2")
# what the operator may write, per transport; everything else is refused by name
ALLOWED_PARAMS: dict[str, frozenset[str]] = {
    "": frozenset(),
    "unix": frozenset({"socket"}),
    "tcp": frozenset(),
    "tls": frozenset(),
    "ssh": frozenset(),
    "libssh": frozenset(),
    "libssh2": frozenset(),
}
SERVER_PARAMS = frozenset({"pkipath", "keyfile", "known_hosts", "known_hosts_verify", "sshauth"})
COMMAND_PARAMS = frozenset({"command", "netcat", "proxy", "socket"})
TLS_FILES = ("cacert.pem", "clientcert.pem", "clientkey.pem")


class HostUriError(ValueError):
    """A host URI the fleet will not open; the message says why."""


@dataclass(frozen=True)
class HostUri:
    driver: str
    transport: str
    host: str
    user: str | None

    @property
    def is_tls(self) -> bool:
        return self.transport == "tls"

    @property
    def is_ssh(self) -> bool:
        return self.transport in SSH_TRANSPORTS


def parse_host_uri(uri: str) -> HostUri:
    """Check a host URI (see the module doc); HostUriError says what is wrong with it."""
    if any(c in uri for c in "\0\n\r\t ") or not uri.isascii():
        raise HostUriError("whitespace, control or non-ASCII characters are not allowed")
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise HostUriError(f"not a valid URI: {exc}") from None
    driver, _, transport = parts.scheme.partition("+")
    if driver not in DRIVERS:
        raise HostUriError(f"unknown driver {driver!r}: use qemu (or test)")
    if transport not in TRANSPORTS:
        raise HostUriError(
            f"transport {transport!r} is not supported: use qemu:///system, qemu+tcp://, "
            "qemu+tls:// or qemu+ssh:// (libvirt's remote protocol only)"
        )
    if not uri.startswith(f"{parts.scheme}://"):
        raise HostUriError("must be a libvirt URI such as qemu:///system or qemu+tls://host/system")
    if parts.fragment:
        raise HostUriError("a fragment (#…) is not allowed")
    host = parts.hostname or ""
    if transport in ("tcp", "tls", *SSH_TRANSPORTS) and not host:
        raise HostUriError(f"qemu+{transport}:// needs a host name or address")
    if transport in ("", "unix") and host:
        raise HostUriError("a remote host needs a network transport: qemu+tls://, qemu+ssh://")
    if parts.password is not None:
        raise HostUriError("a password in the URI is not allowed (give an SSH key)")
    if parts.username is not None and transport not in SSH_TRANSPORTS:
        raise HostUriError(f"a user name is only meaningful for qemu+ssh://, not {parts.scheme}")
    try:
        params = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise HostUriError("the query string is not name=value pairs") from None
    seen: set[str] = set()
    for name, _value in params:
        if name in seen:
            raise HostUriError(f"parameter {name!r} is given twice")
        seen.add(name)
        if name == "no_verify":
            raise HostUriError("no_verify is not allowed: certificates and host keys are checked")
        if name in SERVER_PARAMS:
            raise HostUriError(
                f"parameter {name!r} is set by the server from the host's credentials "
                "(tls_pki_dir, ssh key): do not put it in the URI"
            )
        if name in ALLOWED_PARAMS[transport]:
            continue
        if name in COMMAND_PARAMS:
            raise HostUriError(
                f"parameter {name!r} is not allowed: it would run a command (or name one) "
                "on this machine or the host; the fleet speaks libvirt's remote protocol only"
            )
        raise HostUriError(f"unknown parameter {name!r}")
    return HostUri(driver=driver, transport=transport, host=host, user=parts.username)


def _known_hosts_has_entry(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return any(line.strip() and not line.lstrip().startswith("#") for line in f)
    except FileNotFoundError:
        return False


def check_credentials(
    parsed: HostUri,
    *,
    tls_pki_dir: str | None,
    ssh_key_file: str | None,
    ssh_known_hosts: str | None,
) -> None:
    """Credentials fit the transport: a pki directory only for qemu+tls, an SSH key and its
    known_hosts file only (and together) for qemu+ssh. Without them libvirt's defaults apply
    (``/etc/pki/libvirt``, the server user's ``~/.ssh``): the server's API always gives them."""
    if tls_pki_dir is not None and not parsed.is_tls:
        raise HostUriError("tls_pki_dir is only for qemu+tls:// hosts")
    if (ssh_key_file is not None or ssh_known_hosts is not None) and not parsed.is_ssh:
        raise HostUriError("an SSH key is only for qemu+ssh:// hosts")
    if (ssh_key_file is None) != (ssh_known_hosts is None):
        raise HostUriError("an SSH key needs its known_hosts file (empty: trust on first use)")


def connection_uri(
    uri: str,
    *,
    tls_pki_dir: str | None = None,
    ssh_key_file: str | None = None,
    ssh_known_hosts: str | None = None,
) -> str:
    """The URI to open for a (checked) host URI, with the credential parameters added."""
    parsed = parse_host_uri(uri)
    parts = urlsplit(uri)
    params = parse_qsl(parts.query, keep_blank_values=True)
    scheme = parts.scheme
    check_credentials(
        parsed, tls_pki_dir=tls_pki_dir, ssh_key_file=ssh_key_file, ssh_known_hosts=ssh_known_hosts
    )
    if tls_pki_dir is not None:
        params.append(("pkipath", tls_pki_dir))
    if ssh_key_file is not None and ssh_known_hosts is not None:
        scheme = f"{parsed.driver}+libssh2"
        verify = "normal" if _known_hosts_has_entry(ssh_known_hosts) else "auto"
        params += [
            ("sshauth", "privkey"),
            ("keyfile", ssh_key_file),
            ("known_hosts", ssh_known_hosts),
            ("known_hosts_verify", verify),
        ]
    query = urlencode(params, quote_via=quote, safe="/")
    return urlunsplit((scheme, parts.netloc, parts.path, query, ""))


def missing_tls_files(pki_dir: str) -> list[str]:
    """The libvirt client files that `pki_dir` lacks (empty when it is complete)."""
    return [n for n in TLS_FILES if not os.path.isfile(os.path.join(pki_dir, n))]
