"""HTTP under the clients: one aiohttp session, the bearer token, problem+json → exceptions,
Server-Sent Events, and several nodes of one cluster (redirects to the leader followed here,
within the rules in `Transport`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel
from yarl import URL

from agentic_sandbox.sdk.errors import ConfigError, ConnectionFailed, RedirectRefused, from_response

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


MAX_HOPS = 3  # redirects one request may follow (a follower's 307 to the leader is one)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # re-asked elsewhere when a node dies
ELECTION_WAIT = 15.0  # seconds a request waits out a "no node leads right now" (503)


def split_urls(url: str | Sequence[str]) -> list[str]:
    """`"http://a:1,http://b:2"` or a list: the base URLs, without trailing slashes."""
    items = url.split(",") if isinstance(url, str) else list(url)
    out = [u.strip().rstrip("/") for u in items if u.strip()]
    if not out:
        raise ConfigError("no server URL given")
    return out


def origin(url: str) -> str:
    """`scheme://host:port` of a URL (the port spelled out), for comparing where one points."""
    u = URL(url)
    if not u.is_absolute() or u.scheme not in ("http", "https"):
        return ""
    return f"{u.scheme}://{(u.host or '').lower()}:{u.port}"


class Transport:
    """The HTTP session of one client (opened on first use, closed by `close()`).

    Several URLs name the nodes of one cluster (control hosts on one PostgreSQL). Requests go
    to the one that answered last (the leader, once known). A node that cannot be reached
    is skipped for the next. Redirects are followed here, not by aiohttp (which drops
    `Authorization` on a redirect to another origin): a 307/308 is re-sent with the same
    method, body and token only to an origin in the URL list, or one that a listed node's
    `/readyz` names as the leader, and at most `MAX_HOPS` times."""

    def __init__(
        self, url: str | Sequence[str], token: str | None, *, timeout: float = 60.0
    ) -> None:
        self.urls = split_urls(url)
        self.url = self.urls[0]  # where requests go: the leader once a redirect named it
        self.token = token
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._advertised: set[str] = set()  # leaders' origins named by listed nodes' /readyz
        self._resolved = False  # resolve_leader() has asked the nodes

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

    # ---- which node -----------------------------------------------------------------------
    def _candidates(self) -> list[str]:
        """The current node first, then the listed ones after it in order."""
        rest = [u for u in self.urls if u != self.url]
        if self.url in self.urls:
            i = self.urls.index(self.url)
            rest = self.urls[i + 1 :] + self.urls[:i]
        return [self.url, *rest]

    async def _readyz(self, base: str) -> dict[str, Any] | None:
        try:
            async with self.session.get(
                base + "/readyz",
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    async def _advertised_leaders(self) -> None:
        """Ask every listed node whom it follows; remember those leaders' origins."""
        for base in self.urls:
            doc = await self._readyz(base)
            leader = (doc or {}).get("leader")
            if isinstance(leader, dict) and isinstance(leader.get("url"), str):
                self._advertised.add(origin(leader["url"]))

    async def _may_follow(self, target: str) -> bool:
        want = origin(target)
        if not want:
            return False
        if want in {origin(u) for u in self.urls} | self._advertised:
            return True
        await self._advertised_leaders()
        return want in self._advertised

    async def resolve_leader(self) -> str:
        """The base URL of the node that leads (asked of the listed nodes' `/readyz`), kept
        for what follows; the current URL when no node says (single-node, or nobody leads).
        WebSockets and streamed uploads call it first: they cannot follow a redirect."""
        if self._resolved:
            return self.url
        for base in self._candidates():
            doc = await self._readyz(base)
            if doc is None:
                continue
            role, leader = doc.get("role"), doc.get("leader")
            if role in ("leader", "single-node"):
                self.url, self._resolved = base, True
                break
            if isinstance(leader, dict) and isinstance(leader.get("url"), str):
                url = leader["url"].rstrip("/")
                if await self._may_follow(url):
                    self.url, self._resolved = url, True
                    break
        return self.url

    def forget_leader(self) -> None:
        """The node in use could not be reached: ask again on the next `resolve_leader()`."""
        self._resolved = False
        if len(self.urls) > 1:
            self.url = self._candidates()[1]

    @contextlib.asynccontextmanager
    async def _open(
        self, method: str, path: str, **kw: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The response to `method path` from the node that serves it: the next node when one
        cannot be reached, a redirect re-sent where allowed, a leaderless moment waited out."""
        wait_until = time.monotonic() + ELECTION_WAIT
        while True:
            resp = await self._send(method, path, kw)
            if resp.status == 503 and time.monotonic() < wait_until:
                body = await resp.read()
                if _problem_code(body) == "no-leader":
                    resp.release()
                    delay = _retry_after(resp.headers.get("Retry-After"))
                    await asyncio.sleep(min(delay, max(0.0, wait_until - time.monotonic())))
                    self._resolved = False  # resolve_leader() has asked the nodes
                    continue
            break
        try:
            yield resp
        finally:
            resp.release()

    async def _send(self, method: str, path: str, kw: dict[str, Any]) -> aiohttp.ClientResponse:
        last: aiohttp.ClientError | None = None
        for base in self._candidates():
            try:
                resp = await self._follow(base, method, path, kw)
            except aiohttp.ClientConnectorError as exc:  # nothing was sent: try the next
                last = exc
                self._resolved = False
                continue
            except aiohttp.ServerDisconnectedError as exc:
                # A node that died with our request unanswered: a read is asked of the next;
                # a write may have been applied, so its caller hears ConnectionFailed.
                if method not in SAFE_METHODS:
                    raise
                last = exc
                self._resolved = False
                continue
            return resp
        assert last is not None
        raise last

    async def _follow(
        self, base: str, method: str, path: str, kw: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        url, params = base + path, kw.get("params")
        for _ in range(MAX_HOPS + 1):
            resp = await self.session.request(
                method, url, **{**kw, "params": params}, allow_redirects=False
            )
            if resp.status not in (307, 308):
                self.url = base
                return resp
            location = resp.headers.get("Location", "")
            resp.release()
            target = str(URL(url).join(URL(location))) if location else ""
            if not target or not await self._may_follow(target):
                raise RedirectRefused(
                    f"{origin(url) or url} redirected {method} {path} to "
                    f"{location or 'nowhere'!r}, which is not one of this client's servers "
                    f"({', '.join(self.urls)}) nor a leader one of them names; not re-sent"
                )
            url, params = target, None  # the Location carries the query
            base = base_of(target, path)
        raise RedirectRefused(
            f"{method} {path}: more than {MAX_HOPS} redirects (last to {url}); not re-sent"
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        auth: bool = True,
        raw: bool = False,
        data: bytes | None = None,
        content_type: str = "application/octet-stream",
    ) -> Any:
        """The decoded JSON answer (None for 204), bytes for other content (or with `raw`);
        raises the `ApiError` subclass of a refusal, `ConnectionFailed` when the server is
        unreachable. `data` is a raw body (of `content_type`) instead of `json_body`."""
        headers = self.headers() if auth else {}
        sent: dict[str, Any] = {"json": json_body}
        if data is not None:
            headers = {**headers, "Content-Type": content_type}
            sent = {"data": data}
        try:
            async with self._open(
                method, path, **sent, params=clean_params(params), headers=headers
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
            async with self._open(
                method,
                path,
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
            async with self._open(
                "GET",
                path,
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


def base_of(target: str, path: str) -> str:
    """The base URL a redirect for `path` points at: `Location` without that path and its
    query (a leader's public URL may have a path prefix), else its origin."""
    u = URL(target).with_query(None).with_fragment(None)
    want = path.split("?", 1)[0]
    text = str(u)
    if want and text.endswith(want):
        return text[: -len(want)].rstrip("/")
    return str(u.origin()).rstrip("/")


def _problem_code(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    return str(doc.get("code") or "") if isinstance(doc, dict) else ""


def _retry_after(value: str | None) -> float:
    try:
        return min(max(float(value or 1), 0.1), 5.0)
    except ValueError:
        return 1.0
