"""The egress proxy's CA into the guest's trust store (a stream of kind `egress_trust`).

For destinations with a brokered credential the host's egress proxy terminates the guest's TLS
with a CA of the instance's incarnation (its key never leaves the host). The server sends that
CA's certificate at every registration of the link — a fresh instance, a clone, a warm-pool
member taken into use and a server restart each may mean a new one — and the agent writes it
to `egress_ca_file` (atomically, 0644; Debian's `update-ca-certificates` picks it up from
there whenever it runs) and splices it into `egress_ca_bundle`, the bundle OpenSSL, curl,
Python and git read (`/etc/ssl/certs/ca-certificates.crt`): the previous egress CA's block is
replaced, every other certificate kept, and the new bundle renamed into place. No
`update-ca-certificates` run: it forks `openssl` per certificate, which in a TCG guest took
minutes and starved the agent's link. Only agents configured with `egress_ca_file` offer the
kind: a host agent never touches its host's store.

What arrives is checked to be one PEM certificate and nothing else (no key, no bundle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path

from agentic_sandbox.agent.streams import Inert, Stream, StreamRefused
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

MAX_PEM = 16 * 1024
MAX_BUNDLE = 16 * 1024 * 1024
BEGIN = b"# agentic-sandbox egress CA (replaced by the agent at each registration)\n"
END = b"# end of agentic-sandbox egress CA\n"
_PEM_RE = re.compile(
    rb"\A-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----\r?\n?\Z"
)


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def spliced(bundle: bytes, pem: bytes) -> bytes:
    """`bundle` without an earlier egress CA block, with `pem` as the new one at its end."""
    at = bundle.find(BEGIN)
    if at >= 0:
        end = bundle.find(END, at)
        bundle = bundle[:at] + (bundle[end + len(END) :] if end >= 0 else b"")
    if bundle and not bundle.endswith(b"\n"):
        bundle += b"\n"
    return bundle + BEGIN + pem.rstrip(b"\r\n") + b"\n" + END


def _splice_into(bundle_path: str, pem: bytes) -> None:
    real = Path(os.path.realpath(bundle_path))  # a symlinked bundle: replace its target
    try:
        st = real.stat()
        if st.st_size > MAX_BUNDLE:
            raise OSError(f"over {MAX_BUNDLE} bytes")
        current = real.read_bytes()
        mode = st.st_mode & 0o7777
    except FileNotFoundError:
        current, mode = b"", 0o644
    write_atomically(real, spliced(current, pem), mode)


async def install(ca_file: str, bundle: str, pem: bytes) -> pb.StreamClose:
    """Write the CA, splice it into the bundle; the close to answer with."""
    path = ca_file
    try:
        await asyncio.to_thread(write_atomically, Path(ca_file), pem)
        if bundle:
            path = bundle
            await asyncio.to_thread(_splice_into, bundle, pem)
    except OSError as exc:
        return pb.StreamClose(
            error=pb.StreamError(code="io", message=f"{path}: {exc.strerror or exc}")
        )
    log.info("egress proxy CA installed in %s%s", ca_file, f" and {bundle}" if bundle else "")
    return pb.StreamClose(egress_trust=pb.EgressTrustResult(path=ca_file, refreshed=bool(bundle)))


def open_trust_stream(
    ca_file: str,
    bundle: str,
    background: set[asyncio.Future[None]],
    stream: Stream,
    msg: pb.StreamOpen,
) -> tuple[Inert, pb.StreamAccept]:
    pem = bytes(msg.egress_trust.ca_pem)
    if len(pem) > MAX_PEM or not _PEM_RE.match(pem):
        raise StreamRefused("bad-certificate", "not one PEM certificate", "ca_pem")

    async def run() -> None:
        close = await install(ca_file, bundle, pem)
        stream.finish(close)

    task = asyncio.ensure_future(run())
    background.add(task)
    task.add_done_callback(background.discard)
    return Inert(), pb.StreamAccept()
