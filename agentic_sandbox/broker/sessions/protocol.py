"""The browser WebSocket protocol `sandbox.pty.v1` (see docs/sessions.md).

- server -> client binary: 8-byte big-endian offset of the first byte, then output bytes;
- client -> server binary: input bytes (controller only);
- text frames: JSON control messages with a `type`.

Client messages are validated strictly (unknown fields, wrong types and unknown types are
refused with an `error` frame naming the problem; the connection and the session go on).
Server messages are made by the typed builders at the end (`hello`, `resync`, `role`,
`members`, `resize`, `exit_`, `error`, `pong`), nowhere else: each returns the encoded text
frame, so a message is encoded once however many clients it goes to.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agentic_sandbox.broker.http.body import decode_json

SUBPROTOCOL = "sandbox.pty.v1"
MAX_CONTROL_BYTES = 8 * 1024
MAX_INPUT_BYTES = 64 * 1024
MAX_COLS = 1000
MAX_ROWS = 500
SIGNALS = ("INT", "TERM", "KILL", "HUP")

ClientRole = Literal["controller", "observer"]
ROLE_CONTROLLER: ClientRole = "controller"
ROLE_OBSERVER: ClientRole = "observer"
ResyncReason = Literal["initial", "behind", "offset-unavailable"]
ErrorCode = Literal[
    # the client's frame
    "bad-json",
    "bad-message",
    "unknown-type",
    "frame-too-large",
    # what the client asked for
    "not-controller",
    "control-held",
    "forbidden",
    "session-ended",
    # the session's agent or the server
    "agent-unavailable",
    "agent-disconnected",
    "instance-deleted",
    "server-shutdown",
]


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
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


# ---- server -> client ------------------------------------------------------------------------
class Member(TypedDict):
    id: str
    subject: str
    role: ClientRole


def _dumps(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)


def hello(
    *,
    session: str,
    instance: str,
    you: str,
    role: ClientRole,
    cols: int,
    rows: int,
    state: str,
    start: int,
    end: int,
    from_: int | None,
    members: list[Member],
) -> str:
    """The first message to a client; `from_` is where binary frames start (None when a
    `resync` follows)."""
    return _dumps(
        {
            "type": "hello",
            "protocol": SUBPROTOCOL,
            "session": session,
            "instance": instance,
            "you": you,
            "role": role,
            "cols": cols,
            "rows": rows,
            "state": state,
            "offset": {"start": start, "end": end},
            "from": from_,
            "members": members,
        }
    )


def resync(reason: ResyncReason, *, offset: int, cols: int, rows: int, screen: str) -> str:
    """Reset the terminal, write `screen` (ANSI that repaints it), continue at `offset`."""
    return _dumps(
        {
            "type": "resync",
            "reason": reason,
            "offset": offset,
            "cols": cols,
            "rows": rows,
            "screen": screen,
        }
    )


def role(role: ClientRole, reason: str) -> str:
    return _dumps({"type": "role", "role": role, "reason": reason})


def members(members: list[Member]) -> str:
    return _dumps({"type": "members", "members": members})


def resize(cols: int, rows: int) -> str:
    return _dumps({"type": "resize", "cols": cols, "rows": rows})


def exit_(*, code: int | None, signal: str | None, lost: bool, reason: str, offset: int) -> str:
    """After the last output (`offset` is its end); the server then closes with 1000."""
    return _dumps(
        {
            "type": "exit",
            "code": code,
            "signal": signal,
            "lost": lost,
            "reason": reason,
            "offset": offset,
        }
    )


def error(code: ErrorCode, message: str) -> str:
    return _dumps({"type": "error", "code": code, "message": message})


def pong(id: str | int | None) -> str:
    return _dumps({"type": "pong", "id": id})
