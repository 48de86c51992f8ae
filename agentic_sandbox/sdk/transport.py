"""HTTP under the clients: one aiohttp session, the bearer token, problem+json → exceptions,
and Server-Sent Events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel

from agentic_sandbox.sdk.errors import ConnectionFailed, from_response

M = TypeVar("M", bound=BaseModel)

USER_AGENT = "agentic-sandbox-sdk/0.1"


@dataclass(frozen=True)
class SseEvent:
    """One Server-Sent Event: `event` (its name, "message" when it had none), `id`, `data`."""

    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class _SseParser:
    """The text/event-stream format, line by line (WHATWG HTML, "Parsing an event stream")."""

    event: str = ""
    data: list[str] = field(default_factory=list)
    id: str | None = None

    def feed(self, line: str) -> SseEvent | None:
        if not line:
            out = None
            if self.data:
                out = SseEvent(self.event or "message", "\n".join(self.data), self.id)
            self.event, self.data = "", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.event = value
        elif name == "id" and "\0" not in value:
            self.id = value
        return None


def clean_params(params: Mapping[str, Any] | None) -> dict[str, str]:
    """Query parameters without the unset ones; booleans as `true`/`false`."""
    out: dict[str, str] = {}
    for key, value in (params or {}).items():
        if value is None:
            continue
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, list | tuple):
            out[key] = ",".join(str(v) for v in value)
        else:
            out[key] = str(value)
    return out


class Transport:
    """The HTTP session of one client (opened on first use, closed by `close()`)."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, headers={"User-Agent": USER_AGENT}
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _connection_failed(self, exc: aiohttp.ClientError) -> ConnectionFailed:
        if isinstance(exc, aiohttp.ClientConnectorError):
            return ConnectionFailed(f"cannot reach the server at {self.url}: {exc.os_error}")
        return ConnectionFailed(f"the connection to {self.url} broke: {exc}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        auth: bool = True,
        raw: bool = False,
    ) -> Any:
        """The decoded JSON answer (None for 204), bytes for other content (or with `raw`);
        raises the `ApiError` subclass of a refusal, `ConnectionFailed` when the server is
        unreachable."""
        try:
            async with self.session.request(
                method,
                self.url + path,
                json=json_body,
                params=clean_params(params),
                headers=self.headers() if auth else {},
            ) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise from_response(resp.status, body, resp.headers.get("Retry-After"))
                if raw:
                    return body
                if resp.status == 204 or not body:
                    return None
                if resp.content_type.endswith("json"):
                    return json.loads(body)
                return body
        except aiohttp.ClientError as exc:
            raise self._connection_failed(exc) from None

    async def model(self, cls: type[M], method: str, path: str, **kw: Any) -> M:
        return cls.model_validate(await self.request(method, path, **kw))

    async def items(
        self, cls: type[M], path: str, params: Mapping[str, Any] | None = None
    ) -> list[M]:
        doc = await self.request("GET", path, params=params)
        return [cls.model_validate(item) for item in doc["items"]]

    async def ndjson(
        self, method: str, path: str, *, json_body: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        """The JSON objects of one NDJSON response, one per line, as they come (no read
        timeout: a long-running command may be quiet for a while)."""
        try:
            async with self.session.request(
                method,
                self.url + path,
                json=json_body,
                headers={**self.headers(), "Accept": "application/x-ndjson"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None),
            ) as resp:
                if resp.status >= 400:
                    body = await resp.read()
                    raise from_response(resp.status, body, resp.headers.get("Retry-After"))
                async for raw in resp.content:
                    if raw.strip():
                        yield json.loads(raw)
        except aiohttp.ClientError as exc:
            raise self._connection_failed(exc) from None

    async def sse(
        self,
        path: str,
        params: Mapping[str, Any] | None = None,
        *,
        last_event_id: str | None = None,
    ) -> AsyncIterator[SseEvent]:
        """The events of one Server-Sent Events response, until the server ends it."""
        headers = {**self.headers(), "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        try:
            async with self.session.get(
                self.url + path,
                params=clean_params(params),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None),
            ) as resp:
                if resp.status >= 400:
                    body = await resp.read()
                    raise from_response(resp.status, body, resp.headers.get("Retry-After"))
                parser = _SseParser()
                async for raw in resp.content:
                    event = parser.feed(raw.decode("utf-8", "replace").rstrip("\r\n"))
                    if event is not None:
                        yield event
        except aiohttp.ClientError as exc:
            raise self._connection_failed(exc) from None
