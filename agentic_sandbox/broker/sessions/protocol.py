"""The browser WebSocket protocol `sandbox.pty.v1` (see docs/sessions.md).

- server -> client binary: 8-byte big-endian offset of the first byte, then output bytes;
- client -> server binary: input bytes (controller only);
- text frames: JSON control messages with a `type`.

Client messages are validated strictly (unknown fields, wrong types and unknown types are
refused with an `error` frame naming the problem; the connection and the session go on).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agentic_sandbox.broker.http.body import decode_json

SUBPROTOCOL = "sandbox.pty.v1"
ROLE_CONTROLLER = "controller"
ROLE_OBSERVER = "observer"
MAX_CONTROL_BYTES = 8 * 1024
MAX_INPUT_BYTES = 64 * 1024
MAX_COLS = 1000
MAX_ROWS = 500
SIGNALS = ("INT", "TERM", "KILL", "HUP")


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ResizeMsg(_Msg):
    type: Literal["resize"]
    cols: int = Field(ge=1, le=MAX_COLS)
    rows: int = Field(ge=1, le=MAX_ROWS)


class RequestControlMsg(_Msg):
    type: Literal["request_control"]
    force: bool = False


class ReleaseControlMsg(_Msg):
    type: Literal["release_control"]


class SignalMsg(_Msg):
    type: Literal["signal"]
    signal: Literal["INT", "TERM", "KILL", "HUP"]


class PingMsg(_Msg):
    type: Literal["ping"]
    id: str | int | None = Field(default=None)


ClientMessage = Annotated[
    ResizeMsg | RequestControlMsg | ReleaseControlMsg | SignalMsg | PingMsg,
    Field(discriminator="type"),
]
_CLIENT = TypeAdapter(ClientMessage)
CLIENT_TYPES = ("resize", "request_control", "release_control", "signal", "ping")


AnyClientMessage = ResizeMsg | RequestControlMsg | ReleaseControlMsg | SignalMsg | PingMsg


def parse_client_text(text: str) -> AnyClientMessage:
    """Parse one client text frame or raise ProtocolError (code, message)."""
    if len(text) > MAX_CONTROL_BYTES:
        raise ProtocolError(
            "frame-too-large", f"control messages are at most {MAX_CONTROL_BYTES} bytes"
        )
    try:
        obj: Any = decode_json(text)
    except ValueError as exc:
        raise ProtocolError("bad-json", f"control message is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad-message", "a control message is a JSON object with a `type`")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("bad-message", "a control message needs a string `type`")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(
            "unknown-type",
            f"unknown message type {kind[:40]!r}; known: {', '.join(CLIENT_TYPES)}",
        )
    if kind == "ping" and isinstance(obj.get("id"), str) and len(obj["id"]) > 64:
        raise ProtocolError("bad-message", "ping.id: at most 64 characters")
    try:
        return _CLIENT.validate_python(obj)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_context=False)[0]
        loc = ".".join(str(p) for p in err["loc"][1:]) or kind
        raise ProtocolError("bad-message", f"{kind}.{loc}: {err['msg']}") from None


def dumps(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)


def error(code: str, message: str) -> str:
    return dumps({"type": "error", "code": code, "message": message})
