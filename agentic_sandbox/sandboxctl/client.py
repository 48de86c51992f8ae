"""HTTP client for sandboxctl: turns problem+json into clear errors and exit codes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

# Exit codes (documented in `sandboxctl --help`).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_AUTH = 4
EXIT_CONFLICT = 5
EXIT_INVALID = 6
EXIT_UNAVAILABLE = 7

_STATUS_EXIT = {
    400: EXIT_INVALID,
    401: EXIT_AUTH,
    403: EXIT_AUTH,
    404: EXIT_NOT_FOUND,
    409: EXIT_CONFLICT,
    413: EXIT_INVALID,
    415: EXIT_INVALID,
    422: EXIT_INVALID,
    429: EXIT_UNAVAILABLE,
    503: EXIT_UNAVAILABLE,
}


class CliError(Exception):
    def __init__(
        self, message: str, code: int = EXIT_ERROR, problem: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.problem = problem or {}  # the server's problem document, when it sent one


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None


def _problem(status: int, body: bytes) -> tuple[str, dict[str, Any]]:
    """The message for a refusal, and the problem document (empty if it was none)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"HTTP {status}: {body[:200].decode(errors='replace')}", {}
    if not isinstance(doc, dict):
        return f"HTTP {status}", {}
    detail = doc.get("detail") or doc.get("title") or f"HTTP {status}"
    errors = doc.get("errors") or []
    extra = "".join(f"\n  {e.get('field')}: {e.get('message')}" for e in errors[1:])
    return f"{detail}{extra}", doc


def refusal(status: int, body: bytes) -> CliError:
    message, doc = _problem(status, body)
    return CliError(message, _STATUS_EXIT.get(status, 1), doc)


class Api:
    def __init__(self, target: Target, timeout: float = 60.0) -> None:
        self.target = target
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Api:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    def headers(self) -> dict[str, str]:
        if not self.target.token:
            return {}
        return {"Authorization": f"Bearer {self.target.token}"}

    async def request(
        self, method: str, path: str, *, json_body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        url = self.target.url.rstrip("/") + path
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            async with self.session.request(
                method, url, json=json_body, params=clean, headers=self.headers()
            ) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise refusal(resp.status, body)
                if resp.status == 204 or not body:
                    return None
                if resp.content_type.endswith("json"):
                    return json.loads(body)
                return body
        except aiohttp.ClientConnectorError as exc:
            raise CliError(
                f"cannot reach the server at {self.target.url}: {exc.os_error}", EXIT_UNAVAILABLE
            ) from None

    async def get(self, path: str, **params: Any) -> Any:
        return await self.request("GET", path, params=params)

    async def post(self, path: str, body: Any = None) -> Any:
        return await self.request("POST", path, json_body=body if body is not None else {})

    async def put(self, path: str, body: Any) -> Any:
        return await self.request("PUT", path, json_body=body)

    async def delete(self, path: str) -> Any:
        return await self.request("DELETE", path)

    async def sse(
        self, path: str, params: dict[str, Any], last_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Follow a Server-Sent Events stream, yielding the JSON `data` of each event."""
        headers = self.headers()
        if last_id:
            headers["Last-Event-ID"] = last_id
        url = self.target.url.rstrip("/") + path
        async with self.session.get(url, params=params, headers=headers) as resp:
            if resp.status >= 400:
                raise refusal(resp.status, await resp.read())
            data: list[str] = []
            async for raw in resp.content:
                line = raw.decode().rstrip("\n")
                if not line:
                    if data:
                        yield json.loads("\n".join(data))
                    data = []
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
