"""The egress proxy's CA into the guest's trust store (a stream of kind `egress_trust`).

For destinations with a brokered credential the host's egress proxy terminates the guest's TLS
with a CA of the instance's incarnation (its key never leaves the host). The server sends that
CA's certificate at every registration of the link — a fresh instance, a clone, a warm-pool
member taken into use and a server restart each may mean a new one — and the agent writes it
to `egress_ca_file` (atomically, 0644) and runs `egress_ca_refresh` (in allowlist guests
Debian's `update-ca-certificates`, which rebuilds /etc/ssl/certs from it) at nice 19 (the
agent's link comes first). Only agents
configured with `egress_ca_file` offer the kind: a host agent never touches its host's store.

What arrives is checked to be one PEM certificate and nothing else (no key, no bundle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import tempfile
from pathlib import Path

from agentic_sandbox.agent.streams import Stream, StreamRefused
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

MAX_PEM = 16 * 1024
REFRESH_TIMEOUT = 120.0
_PEM_RE = re.compile(
    rb"\A-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----\r?\n?\Z"
)


class TrustHandler:
    """Nothing more arrives on the stream; a cancel stops nothing (the write is short)."""

    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        return None

    def on_credit(self, channel: int) -> None:
        return None

    def on_close(self, error: pb.StreamError | None) -> None:
        return None


def _background_priority() -> None:
    """In the child: nice 19 — rebuilding the store is a few hundred processes and a rehash,
    and in a slow guest (TCG, a loaded host) it must not starve the agent's own heartbeats
    (at nice 0 a link was lost). Not SCHED_IDLE: with a guest busy running commands that
    never let it finish in 180 s."""
    with contextlib.suppress(OSError):
        os.nice(19)


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


async def install(ca_file: str, refresh: str, pem: bytes) -> pb.StreamClose:
    """Write the CA and rebuild the store; the close to answer with."""
    try:
        await asyncio.to_thread(write_atomically, Path(ca_file), pem)
    except OSError as exc:
        return pb.StreamClose(
            error=pb.StreamError(code="io", message=f"{ca_file}: {exc.strerror or exc}")
        )
    if not refresh:
        return pb.StreamClose(egress_trust=pb.EgressTrustResult(path=ca_file))
    try:
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(refresh),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_background_priority,
        )
    except OSError as exc:
        return pb.StreamClose(
            error=pb.StreamError(code="internal", message=f"{refresh}: {exc.strerror or exc}")
        )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), REFRESH_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return pb.StreamClose(
            error=pb.StreamError(code="internal", message=f"{refresh}: timed out")
        )
    if proc.returncode != 0:
        tail = out.decode("utf-8", "replace")[-400:]
        return pb.StreamClose(
            error=pb.StreamError(
                code="internal", message=f"{refresh}: exit {proc.returncode}: {tail}"
            )
        )
    log.info("egress proxy CA installed in %s (%s)", ca_file, refresh)
    return pb.StreamClose(egress_trust=pb.EgressTrustResult(path=ca_file, refreshed=True))


def open_trust_stream(
    ca_file: str,
    refresh: str,
    background: set[asyncio.Future[None]],
    stream: Stream,
    msg: pb.StreamOpen,
) -> tuple[TrustHandler, pb.StreamAccept]:
    pem = bytes(msg.egress_trust.ca_pem)
    if len(pem) > MAX_PEM or not _PEM_RE.match(pem):
        raise StreamRefused("bad-certificate", "not one PEM certificate", "ca_pem")

    async def run() -> None:
        close = await install(ca_file, refresh, pem)
        stream.finish(close)

    task = asyncio.ensure_future(run())
    background.add(task)
    task.add_done_callback(background.discard)
    return TrustHandler(), pb.StreamAccept()
