"""The agent's side of `egress_trust`: one PEM certificate written atomically where its config
says and spliced into the trust bundle (the previous egress CA replaced, every other
certificate kept, and a real TLS client trusting the result); anything else refused; a
bundle that cannot be written reported."""

from __future__ import annotations

import asyncio
import ssl
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


async def _install(ca_file: Path, bundle: str, pem: bytes) -> pb.StreamClose:
    stream = FakeStream()
    background: set[asyncio.Future[None]] = set()
    msg = pb.StreamOpen(egress_trust=pb.EgressTrust(ca_pem=pem))
    egress_trust.open_trust_stream(str(ca_file), bundle, background, stream, msg)  # type: ignore[arg-type]
    async with asyncio.timeout(30):
        return await stream.closed


def _certs(bundle: Path) -> int:
    return bundle.read_bytes().count(b"-----BEGIN CERTIFICATE-----")


async def test_the_ca_is_written_and_spliced_into_the_bundle(tmp_path: Path) -> None:
    other = IncarnationCA(
        "someone", "else", names=()
    ).certificate_pem  # the store's own certificates
    bundle = tmp_path / "certs" / "ca-certificates.crt"
    bundle.parent.mkdir()
    bundle.write_bytes(other + other.rstrip(b"\n"))  # no newline at the end
    bundle.chmod(0o644)
    ca = IncarnationCA("dev-1", "inc-1", names=())
    target = tmp_path / "ca-certificates" / "egress.crt"
    close = await _install(target, str(bundle), ca.certificate_pem)
    assert not close.HasField("error"), close
    assert (close.egress_trust.path, close.egress_trust.refreshed) == (str(target), True)
    assert target.read_bytes() == ca.certificate_pem
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert _certs(bundle) == 3 and bundle.read_bytes().startswith(other)
    # what a TLS client builds from the bundle trusts the egress CA
    ctx = ssl.create_default_context(cafile=str(bundle))
    subjects = [dict(x[0] for x in c["subject"]).get("commonName") for c in ctx.get_ca_certs()]
    assert "egress CA of dev-1" in subjects, subjects

    newer = IncarnationCA(
        "dev-1", "inc-2", names=()
    ).certificate_pem  # a new incarnation replaces it
    close = await _install(target, str(bundle), newer)
    assert not close.HasField("error"), close
    assert target.read_bytes() == newer
    data = bundle.read_bytes()
    assert _certs(bundle) == 3 and ca.certificate_pem not in data and newer in data
    assert data.count(egress_trust.BEGIN) == 1 and data.startswith(other)
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o644
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["ca-certificates.crt"]
    assert [p.name for p in target.parent.iterdir()] == ["egress.crt"]  # no temporary left


async def test_a_symlinked_bundle_is_spliced_at_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real.crt"
    real.write_bytes(IncarnationCA("x", "y", names=()).certificate_pem)
    link = tmp_path / "bundle.crt"
    link.symlink_to(real)
    close = await _install(
        tmp_path / "egress.crt", str(link), IncarnationCA("a", "b", names=()).certificate_pem
    )
    assert not close.HasField("error"), close
    assert link.is_symlink() and _certs(real) == 2


async def test_a_bundle_that_cannot_be_written_is_reported(tmp_path: Path) -> None:
    pem = IncarnationCA("dev-1", "inc-1", names=()).certificate_pem
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the bundle's directory should be")
    close = await _install(tmp_path / "egress.crt", str(blocked / "bundle.crt"), pem)
    assert close.error.code == "io" and str(blocked / "bundle.crt") in close.error.message


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        IncarnationCA("a", "b", names=()).certificate_pem * 2,
        b"not pem at all",
    ],
)
async def test_anything_but_one_certificate_is_refused(tmp_path: Path, pem: bytes) -> None:
    msg = pb.StreamOpen(egress_trust=pb.EgressTrust(ca_pem=pem))
    with pytest.raises(StreamRefused) as err:
        egress_trust.open_trust_stream(str(tmp_path / "x.crt"), "", set(), object(), msg)  # type: ignore[arg-type]
    assert err.value.code == "bad-certificate"
    assert not (tmp_path / "x.crt").exists()
