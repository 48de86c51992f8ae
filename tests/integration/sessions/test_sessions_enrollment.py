"""Enrollment and mutual TLS: refusals are refused *and* logged, audited, counted, published.

Real server subprocess; the test speaks gRPC to it directly (and starts real agent-clients).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc
from tests.support.agents import AgentProcess, enrollment_token, register_host_instance
from tests.support.fixtures import AgentFactory, ServerFactory, unique_id
from tests.support.server import ServerProcess
from tests.support.sessions import events, metric

pytestmark = pytest.mark.timeout(180)
SERVER_NAME = "agentic-sandbox-server"


def _key_and_csr(cn: str = "whatever") -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM)


def _options() -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", SERVER_NAME)]


async def _enroll(server: ServerProcess, instance_id: str, token: str) -> tuple[bytes, bytes]:
    key_pem, csr_pem = _key_and_csr()
    creds = grpc.ssl_channel_credentials(root_certificates=server.ca_path.read_bytes())
    async with grpc.aio.secure_channel(server.enroll_target, creds, options=_options()) as ch:
        resp = await pb_grpc.AgentLinkStub(ch).Enroll(
            pb.EnrollRequest(instance_id=instance_id, token=token, csr_pem=csr_pem), timeout=10
        )
    return key_pem, resp.certificate_pem


async def _refused(server: ServerProcess, instance_id: str, token: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _enroll(server, instance_id, token)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    return err.value


async def _connect(
    server: ServerProcess, key_pem: bytes, cert_pem: bytes, claim: str
) -> pb.ServerMessage:
    creds = grpc.ssl_channel_credentials(
        root_certificates=server.ca_path.read_bytes(),
        private_key=key_pem,
        certificate_chain=cert_pem,
    )
    async with grpc.aio.secure_channel(server.grpc_target, creds, options=_options()) as ch:
        call = pb_grpc.AgentLinkStub(ch).Connect(timeout=10)
        await call.write(pb.AgentMessage(register=pb.Register(instance_id=claim)))
        first = await call.read()
        call.cancel()
        assert first is not grpc.aio.EOF
        return first


def _audit_denied(server: ServerProcess, action: str) -> list[dict[str, object]]:
    out = server.ok("GET", "/api/v2/admin/audit?outcome=denied&limit=1000")
    return [e for e in out["items"] if e["action"] == action]


async def test_enrollment_refusals_and_a_valid_enrollment(sandbox_server: ServerProcess) -> None:
    server = sandbox_server
    a, b = unique_id("enr-a"), unique_id("enr-b")
    register_host_instance(server, a)
    register_host_instance(server, b)

    # A valid one works: the certificate names the token's instance.
    token = enrollment_token(server, a)
    key_pem, cert_pem = await _enroll(server, a, token)
    cert = x509.load_pem_x509_certificate(cert_pem)
    uris = cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.UniformResourceIdentifier)
    incarnation = server.ok("GET", f"/api/v2/admin/instances/{a}")["incarnation"]
    assert uris == [
        f"spiffe://agentic-sandbox/instance/{a}",
        f"urn:agentic-sandbox:incarnation:{incarnation}",
    ]
    ack = await _connect(server, key_pem, cert_pem, a)
    assert ack.WhichOneof("body") == "register_ack"

    # Reused.
    err = await _refused(server, a, token)
    assert "already used" in (err.details() or "")
    # Foreign: a token of instance b presented for instance a.
    token_b = enrollment_token(server, b)
    err = await _refused(server, a, token_b)
    assert "another instance" in (err.details() or "")
    # ... which did not consume it: b can still enroll with it.
    await _enroll(server, b, token_b)
    # Expired.
    short = enrollment_token(server, a, ttl=1)
    time.sleep(1.5)
    err = await _refused(server, a, short)
    assert "expired" in (err.details() or "")
    # Unknown (e.g. another server's).
    await _refused(server, a, "sbe_" + "x" * 43)

    # A certificate of instance a used to act as instance b: refused, and b gets no link.
    with pytest.raises(grpc.aio.AioRpcError) as cerr:
        await _connect(server, key_pem, cert_pem, b)
    assert cerr.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert server.ok("GET", f"/api/v2/admin/agents/{b}")["state"] != "connected"

    # Logged, audited, counted and published.
    log = server.log_text()
    for reason in ("reused_token", "foreign_token", "expired_token", "unknown_token"):
        assert reason in log
        assert metric(server, "sandbox_agent_enrollments_total", f'outcome="{reason}"') >= 1
    assert "instance_mismatch" in log
    assert metric(server, "sandbox_agent_enrollments_total", 'outcome="ok"') >= 2
    assert metric(server, "sandbox_auth_failures_total", 'reason="agent-enroll"') >= 4
    assert metric(server, "sandbox_auth_failures_total", 'reason="agent-connect"') >= 1
    assert len(_audit_denied(server, "agent.enroll")) >= 4
    assert _audit_denied(server, "agent.connect")
    refused = events(server, "agent.refused")
    assert {e["data"]["reason"] for e in refused} >= {
        "reused_token",
        "foreign_token",
        "expired_token",
        "instance_mismatch",
    }
    assert events(server, "agent.enrolled", instance_id=a)


async def test_without_a_valid_client_certificate_there_is_no_link(
    sandbox_server: ServerProcess, tmp_path: Path
) -> None:
    server = sandbox_server
    inst = unique_id("nocert")
    register_host_instance(server, inst)

    # Plain text to the mutual-TLS port: the TLS handshake never completes.
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        call = pb_grpc.AgentLinkStub(ch).Connect(timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.write(pb.AgentMessage(register=pb.Register(instance_id=inst)))
            await call.read()
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    # TLS without a client certificate (the enrollment port): Connect is refused with that
    # code, also when the refusal races the agent's opening message (a large one, as an agent
    # holding many sessions sends, is still being written when a hasty refusal arrives).
    creds = grpc.ssl_channel_credentials(root_certificates=server.ca_path.read_bytes())
    inventory = [pb.SessionInventory(session_id=f"s-{i:05d}-" + "x" * 40) for i in range(5000)]
    codes = []
    async with grpc.aio.secure_channel(server.enroll_target, creds, options=_options()) as ch:
        for sessions in [[], inventory] * 10:
            call = pb_grpc.AgentLinkStub(ch).Connect(timeout=5)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.write(
                    pb.AgentMessage(register=pb.Register(instance_id=inst, sessions=sessions))
                )
                await call.read()
            codes.append((await call.code(), await call.details()))
    assert codes == [(grpc.StatusCode.UNAUTHENTICATED, "client certificate required")] * 20

    # A certificate naming the instance, but from another CA: the handshake fails.
    other_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "evil CA")])
    now = dt.datetime.now(dt.UTC)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, inst)]))
        .issuer_name(name)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"spiffe://agentic-sandbox/instance/{inst}")]
            ),
            critical=False,
        )
        .sign(other_key, hashes.SHA256())
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _connect(
            server,
            leaf_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            leaf.public_bytes(serialization.Encoding.PEM),
            inst,
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.ok("GET", f"/api/v2/admin/agents/{inst}")["state"] == "absent"


async def test_agent_client_with_a_used_token_never_connects(
    sandbox_server: ServerProcess, tmp_path: Path
) -> None:
    server = sandbox_server
    inst = unique_id("used")
    register_host_instance(server, inst)
    token = enrollment_token(server, inst)
    await _enroll(server, inst, token)  # someone else used it first
    agent = AgentProcess(server, inst, tmp_path / "agent", enrollment_token=token).start()
    try:
        deadline = time.monotonic() + 15
        while "already used" not in agent.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "enrollment refused" in agent.log_text()
        assert agent.alive(), "the agent keeps retrying (a new token file may appear)"
        assert server.ok("GET", f"/api/v2/admin/agents/{inst}")["state"] == "absent"
        # An operator drops a fresh token in place: the agent enrolls and connects.
        agent.token_file.write_text(enrollment_token(server, inst))
        agent.wait_connected(timeout=40)
    finally:
        agent.stop()


async def test_certificates_renew_before_expiry(
    server_factory: ServerFactory, agent_factory: AgentFactory
) -> None:
    server = server_factory(SANDBOX_AGENT_CERT_TTL_SECONDS="12")
    agent = agent_factory(server)
    cert_path = agent.state_dir / "agent.crt"
    first = x509.load_pem_x509_certificate(cert_path.read_bytes())
    deadline = time.monotonic() + 30
    renewed = first
    while renewed.serial_number == first.serial_number and time.monotonic() < deadline:
        time.sleep(0.3)
        try:
            renewed = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError:
            continue
    assert renewed.serial_number != first.serial_number, "the certificate was not renewed"
    assert renewed.not_valid_after_utc > first.not_valid_after_utc
    assert (agent.state_dir / "agent.key").stat().st_mode & 0o777 == 0o600
    assert events(server, "agent.renewed", instance_id=agent.instance_id)
    # After the first certificate expires the agent still has a link (with the new one).
    time.sleep(max(0.0, first.not_valid_after_utc.timestamp() - time.time()) + 1.5)
    agent.wait_connected(timeout=20)
