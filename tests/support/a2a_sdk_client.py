"""The official a2a-sdk (1.x) client, set up the way an orchestrator would use it: the card
resolved with signature verification against the agent's JWKS, the card's security scheme
filled by an AuthInterceptor, one binding (JSONRPC or HTTP+JSON) chosen."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from a2a.client import AuthInterceptor, Client, ClientConfig, ClientFactory, CredentialService
from a2a.client.client import ClientCallContext
from a2a.types import a2a_pb2 as pb
from a2a.utils.signing import create_signature_verifier
from google.protobuf.json_format import MessageToDict
from jwt.api_jwk import PyJWK

BINDINGS = ("JSONRPC", "HTTP+JSON")
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


class KeyCredentials(CredentialService):
    def __init__(self, key: str) -> None:
        self.key = key

    async def get_credentials(self, scheme: str, context: ClientCallContext | None) -> str | None:
        return self.key if scheme in ("apiKey", "operatorToken") else None


def jwks_verifier(jwks: dict[str, Any]) -> Any:
    keys = {k["kid"]: PyJWK(k) for k in jwks["keys"]}

    def provider(kid: str | None, jku: str | None) -> PyJWK:
        if kid not in keys:
            raise KeyError(f"unknown kid {kid}")
        return keys[kid]

    return create_signature_verifier(provider, ["EdDSA"])


@asynccontextmanager
async def a2a_client(
    agent_url: str,
    key: str,
    binding: str,
    *,
    streaming: bool = True,
    jwks: dict[str, Any] | None = None,
    signed: bool = True,
) -> AsyncIterator[tuple[Client, pb.AgentCard]]:
    """A client of the agent at `agent_url` as the SDK makes one from its card; `signed`: the
    card's signature is verified with the agent's JWKS (False: an unsigned card, as a2a-sdk's
    own server serves — the benchmark's reference)."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        if jwks is None and signed:
            jwks = (await http.get(agent_url + "/.well-known/jwks.json")).json()
        factory = ClientFactory(
            ClientConfig(
                streaming=streaming,
                supported_protocol_bindings=[binding],
                httpx_client=http,
            )
        )
        client = await factory.create_from_url(
            agent_url,
            interceptors=[AuthInterceptor(KeyCredentials(key))],
            signature_verifier=jwks_verifier(jwks) if jwks is not None else None,
        )
        card = client._card  # type: ignore[attr-defined]
        try:
            yield client, card
        finally:
            await client.close()


def text_message(text: str, **kw: Any) -> pb.Message:
    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=kw.pop("message_id", None) or _mid())
    msg.parts.append(pb.Part(text=text))
    for k, v in kw.items():
        if k == "metadata":
            msg.metadata.update(v)
        else:
            setattr(msg, k, v)
    return msg


def data_message(data: dict[str, Any], skill: str, **kw: Any) -> pb.Message:
    msg = pb.Message(role=pb.Role.ROLE_USER, message_id=kw.pop("message_id", None) or _mid())
    part = pb.Part()
    part.data.struct_value.update(data)
    msg.parts.append(part)
    msg.metadata.update({"skillId": skill})
    return msg


def send_request(
    msg: pb.Message, *, return_immediately: bool = False, history_length: int | None = None
) -> pb.SendMessageRequest:
    req = pb.SendMessageRequest(message=msg)
    req.configuration.return_immediately = return_immediately
    if history_length is not None:
        req.configuration.history_length = history_length
    return req


async def collect(stream: AsyncIterator[pb.StreamResponse]) -> list[pb.StreamResponse]:
    return [ev async for ev in stream]


def state_name(task: pb.Task) -> str:
    return pb.TaskState.Name(task.status.state)


def artifact_text(task: pb.Task) -> str:
    return "".join(p.text for a in task.artifacts for p in a.parts)


def as_dict(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = MessageToDict(message)
    return out


_n = 0


def _mid() -> str:
    import uuid

    return f"m-{uuid.uuid4()}"
