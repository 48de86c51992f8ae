"""Untrusted request bodies: read within a deadline, decode JSON within limits.

Every JSON body the server accepts (admin and v1 routes, both A2A bindings) and every JSON
control frame of the session WebSocket is decoded here, by pydantic-core's parser (jiter)
rather than `json.loads`: it refuses nesting deeper than `MAX_DEPTH` levels and integers of
more than `MAX_INT_DIGITS` digits with an error naming the position — where `json.loads`
raises `RecursionError` or the interpreter's int-conversion `ValueError` (a 500 before) —
and it refuses `NaN`/`Infinity`, lone surrogates and invalid UTF-8.

A body must arrive completely within `http_body_timeout_seconds` of the handler starting to
read it (408 otherwise): a client that announces a length and then trickles or stalls cannot
hold a handler. The size limit is aiohttp's `client_max_size` (413).
"""

from __future__ import annotations

import asyncio

import pydantic_core
from aiohttp import web
from pydantic import JsonValue

MAX_DEPTH = 201  # jiter's recursion limit: the 202nd nested array or object is refused
MAX_INT_DIGITS = 4300  # the interpreter's own int/str conversion limit


class BodyError(Exception):
    """The body cannot be used; `status` is 400, 408 or 413 and `message` says why."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def decode_json(raw: bytes | str) -> JsonValue:
    """Parse JSON or raise `ValueError` with a message a client can act on."""
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise ValueError(_explain(str(exc))) from None


def _explain(message: str) -> str:
    where = message.rpartition(" at ")[2] if " at line " in message else ""
    at = f" (at {where})" if where else ""
    if message.startswith("recursion limit exceeded"):
        return f"JSON nested more than {MAX_DEPTH} levels deep{at}"
    if message.startswith("number out of range"):
        return f"a number is out of range (integers have at most {MAX_INT_DIGITS} digits){at}"
    return message


async def read_body(request: web.Request, seconds: float) -> bytes:
    """The whole body, or `BodyError` (408 when it does not arrive in time, 413 too large)."""
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except TimeoutError:
        raise BodyError(
            408, f"the request body did not arrive within {seconds:g}s", "body-timeout"
        ) from None
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyError(413, f"request body too large ({exc.text})", "payload-too-large") from None


async def read_json_body(request: web.Request, seconds: float) -> tuple[bool, JsonValue]:
    """(False, None) for an empty body, else (True, the decoded document); `BodyError` for a
    late, oversized or malformed one."""
    raw = await read_body(request, seconds)
    if not raw:
        return False, None
    try:
        return True, decode_json(raw)
    except ValueError as exc:
        raise BodyError(400, f"request body is not valid JSON: {exc}", "bad-json") from None
