"""The agent's side of `egress_trust`: one PEM certificate written atomically where its config
says, then the refresh command; anything else refused; a failing command reported."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from agentic_sandbox.agent import egress_trust
from agentic_sandbox.agent.streams import StreamRefused
from agentic_sandbox.broker.egress.interception import IncarnationCA
from agentic_sandbox.proto import agent_pb2 as pb


class FakeStream:
    def __init__(self) -> None:
        self.closed: asyncio.Future[pb.StreamClose] = asyncio.get_running_loop().create_future()

    def finish(self, close: pb.StreamClose) -> None:
        self.closed.set_result(close)


async def _install(ca_file: Path, refresh: str, pem: bytes) -> pb.StreamClose:
    stream = FakeStream()
    background: set[asyncio.Future[None]] = set()
    msg = pb.StreamOpen(egress_trust=pb.EgressTrust(ca_pem=pem))
    egress_trust.open_trust_stream(str(ca_file), refresh, background, stream, msg)  # type: ignore[arg-type]
    async with asyncio.timeout(30):
        return await stream.closed


async def test_the_ca_is_written_and_the_store_refreshed(tmp_path: Path) -> None:
    pem = IncarnationCA("dev-1", "inc-1").certificate_pem
    target = tmp_path / "ca-certificates" / "egress.crt"
    marker = tmp_path / "refreshed"
    close = await _install(target, f"touch {marker}", pem)
    assert not close.HasField("error"), close
    assert (close.egress_trust.path, close.egress_trust.refreshed) == (str(target), True)
    assert target.read_bytes() == pem and marker.exists()
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    newer = IncarnationCA("dev-1", "inc-2").certificate_pem  # a new incarnation replaces it
    close = await _install(target, "", newer)
    assert close.egress_trust.refreshed is False and target.read_bytes() == newer
    assert [p.name for p in target.parent.iterdir()] == ["egress.crt"]  # no temporary left


async def test_a_failing_refresh_is_reported(tmp_path: Path) -> None:
    pem = IncarnationCA("dev-1", "inc-1").certificate_pem
    close = await _install(tmp_path / "egress.crt", "sh -c 'echo broken store; exit 3'", pem)
    assert close.error.code == "internal"
    assert "exit 3" in close.error.message and "broken store" in close.error.message


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        IncarnationCA("a", "b").certificate_pem * 2,
        b"not pem at all",
    ],
)
async def test_anything_but_one_certificate_is_refused(tmp_path: Path, pem: bytes) -> None:
    msg = pb.StreamOpen(egress_trust=pb.EgressTrust(ca_pem=pem))
    with pytest.raises(StreamRefused) as err:
        egress_trust.open_trust_stream(str(tmp_path / "x.crt"), "", set(), object(), msg)  # type: ignore[arg-type]
    assert err.value.code == "bad-certificate"
    assert not (tmp_path / "x.crt").exists()
