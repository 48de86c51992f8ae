"""A hand-driven agent link: a real enrollment and a valid client certificate, and then any
message the test writes — what a hostile agent (or a compromised guest) can send.

    link = await CraftedAgent.enroll(server, "evil-1")
    ack = await link.connect(pb.Register(instance_id="evil-1", sessions=[...]))
    await link.send(pb.AgentMessage(output=pb.SessionOutput(session_id=..., data=b"x")))
    await link.sync()            # the server has handled everything sent so far
    await link.close()

`sync` relies on the server handling one link's messages in order: it sends a heartbeat and
waits for its answer.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc
from tests.support.agents import enrollment_token
from tests.support.server import ServerProcess

SERVER_NAME = "agentic-sandbox-server"
OPTIONS = [
    ("grpc.ssl_target_name_override", SERVER_NAME),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
]


def key_and_csr() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crafted")]))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM)


class CraftedAgent:
    def __init__(self, server: ServerProcess, instance_id: str, key: bytes, cert: bytes) -> None:
        self.server = server
        self.instance_id = instance_id
        self.key = key
        self.cert = cert
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self.received: list[pb.ServerMessage] = []

    @classmethod
    async def enroll(
        cls, server: ServerProcess, instance_id: str, *, token: str | None = None
    ) -> CraftedAgent:
        """Enroll the (already registered) instance with a one-time token, as an agent does."""
        grant = enrollment_token(server, instance_id, token=token)
        key_pem, csr_pem = key_and_csr()
        creds = grpc.ssl_channel_credentials(root_certificates=server.ca_path.read_bytes())
        async with grpc.aio.secure_channel(server.enroll_target, creds, options=OPTIONS) as ch:
            resp = await pb_grpc.AgentLinkStub(ch).Enroll(
                pb.EnrollRequest(instance_id=instance_id, token=grant, csr_pem=csr_pem),
                timeout=10,
            )
        return cls(server, instance_id, key_pem, resp.certificate_pem)

    async def connect(self, register: pb.Register, timeout: float = 30) -> pb.RegisterAck:
        """Open the mutual-TLS stream, send `register`, return the server's answer."""
        await self.close()
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.server.ca_path.read_bytes(),
            private_key=self.key,
            certificate_chain=self.cert,
        )
        self.channel = grpc.aio.secure_channel(self.server.grpc_target, creds, options=OPTIONS)
        self.call = pb_grpc.AgentLinkStub(self.channel).Connect()
        await self.call.write(pb.AgentMessage(register=register))
        first = await self.read(timeout)
        assert first.WhichOneof("body") == "register_ack", first
        return first.register_ack

    async def send(self, msg: pb.AgentMessage) -> None:
        await self.call.write(msg)

    async def read(self, timeout: float = 30) -> pb.ServerMessage:
        import asyncio

        msg = await asyncio.wait_for(self.call.read(), timeout)
        assert msg is not grpc.aio.EOF, "the server closed the link"
        self.received.append(msg)
        return msg  # type: ignore[no-any-return]

    async def sync(self, timeout: float = 30) -> None:
        """Until the server has handled every message sent before this call."""
        stamp = time.time_ns()
        await self.send(
            pb.AgentMessage(heartbeat=pb.Heartbeat(time_unix_ms=stamp // 10**6, want_ack=True))
        )
        while True:
            msg = await self.read(timeout)
            if msg.WhichOneof("body") == "heartbeat_ack":
                return

    async def close(self) -> None:
        if self.call is not None:
            with contextlib.suppress(Exception):
                await self.call.done_writing()
            self.call.cancel()
            self.call = None
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
