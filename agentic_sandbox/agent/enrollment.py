"""Enrollment (a one-time token and a CSR for a certificate naming this instance) and renewal.

Both make the agent's key and CSR with the `openssl` command (`pki`). Enrollment opens its own
channel and closes it before the link is opened (a guest's forward carries one connection at a
time); renewal travels on the live link's channel, or on a fresh one only while there is no
link. A restored guest's key is made while it takes on its new identity (`keys`: started by the
runtime as soon as the new seed is read) and the enrollment channel starts its handshake
before the key is awaited: in an emulated guest each is a few hundred milliseconds of a
hand-off.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from agentic_sandbox.agent import pki
from agentic_sandbox.agent.channels import GatewaySilent, connect_channel
from agentic_sandbox.agent.config import AgentConfig
from agentic_sandbox.agent.controls import ControlAddress, leader_hint
from agentic_sandbox.agent.credentials import Credentials, CredentialsMissing
from agentic_sandbox.proto import agent_pb2 as pb
from agentic_sandbox.proto import agent_pb2_grpc as pb_grpc

log = logging.getLogger("agent")

RPC_TIMEOUT = 15.0


class EnrollmentFailed(Exception):
    """Enrollment did not work; `refused` when the server (or this machine's setup) said no,
    as opposed to the server not being reachable."""

    def __init__(
        self, message: str, *, refused: bool = True, leader: tuple[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.refused = refused
        self.leader = leader  # a follower named the leader: (node, address)


REFUSED = (
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


def _until(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def make_keys(instance_id: str) -> asyncio.Future[tuple[bytes, bytes]]:
    """A key and CSR for `instance_id`, made in a thread (the openssl command)."""
    return asyncio.ensure_future(asyncio.to_thread(pki.new_key_and_csr, instance_id))


async def enroll(
    cfg: AgentConfig,
    creds: Credentials,
    control: ControlAddress,
    keys: asyncio.Future[tuple[bytes, bytes]] | None = None,
) -> None:
    """Enroll with the seed's one-time token. `keys`: a key and CSR already being made for
    this instance (see `make_keys`), else one is made here."""
    token = cfg.token()
    if not token:
        raise EnrollmentFailed("not enrolled and no enrollment token (set enrollment_token_file)")
    started = time.monotonic()
    try:
        channel = await connect_channel(cfg, creds, "enroll", control)
    except CredentialsMissing as exc:
        raise EnrollmentFailed(str(exc)) from None
    except GatewaySilent as exc:
        raise EnrollmentFailed(str(exc), refused=False) from None
    channeled = time.monotonic()
    channel.get_state(try_to_connect=True)  # the handshake goes on while the key is made
    try:
        key, csr = await (keys if keys is not None else make_keys(cfg.instance_id))
    except pki.PkiError as exc:
        await channel.close()
        raise EnrollmentFailed(str(exc)) from None
    except BaseException:
        await channel.close()
        raise
    keyed = time.monotonic()
    try:
        resp = await pb_grpc.AgentLinkStub(channel).Enroll(
            pb.EnrollRequest(instance_id=cfg.instance_id, token=token, csr_pem=csr),
            timeout=RPC_TIMEOUT,
        )
    except grpc.aio.AioRpcError as exc:
        refused = exc.code() in REFUSED
        raise EnrollmentFailed(
            f"enrollment {'refused' if refused else 'failed'} ({exc.code().name}): {exc.details()}",
            refused=refused,
            leader=leader_hint(exc.trailing_metadata()),
        ) from None
    finally:
        await channel.close()
    answered = time.monotonic()
    creds.store(key, resp.certificate_pem, resp.ca_pem, resp.not_after_unix)
    log.info(
        "enrolled as instance %s in %.0f ms (channel %.0f, key %.0f, Enroll %.0f, stored %.0f); "
        "certificate valid until %s",
        cfg.instance_id,
        (time.monotonic() - started) * 1000,
        (channeled - started) * 1000,
        (keyed - channeled) * 1000,
        (answered - keyed) * 1000,
        (time.monotonic() - answered) * 1000,
        _until(resp.not_after_unix),
    )


async def renew(
    cfg: AgentConfig,
    creds: Credentials,
    control: ControlAddress,
    channel: grpc.aio.Channel | None,
) -> None:
    """A new key and certificate, over `channel` (the live link's) or a channel of its own to
    `control`."""
    key, csr = await asyncio.to_thread(pki.new_key_and_csr, cfg.instance_id)
    own = channel is None
    use = await connect_channel(cfg, creds, "link", control) if channel is None else channel
    try:
        resp = await pb_grpc.AgentLinkStub(use).Renew(
            pb.RenewRequest(csr_pem=csr), timeout=RPC_TIMEOUT
        )
    finally:
        if own:
            await use.close()
    creds.store(key, resp.certificate_pem, resp.ca_pem, resp.not_after_unix)
    log.info("certificate renewed; valid until %s", _until(resp.not_after_unix))
