"""A small Server-Sent Events reader for tests: it reads frames in the background.

async with SseReader.open(url, headers) as sse:
    frame = await sse.wait(lambda f: f.event == "revoked", timeout=10)
    await sse.wait_ended(timeout=10)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp


@dataclass
class Frame:
    event: str = "message"
    data: str = ""
    id: str | None = None
    comment: bool = False


@dataclass
class SseReader:
    http: aiohttp.ClientSession
    resp: aiohttp.ClientResponse
    frames: list[Frame] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        url: str,
        headers: dict[str, str] | None = None,
        *,
        method: str = "GET",
        json: Any = None,
        cookies: dict[str, str] | None = None,
    ) -> SseReader:
        http = aiohttp.ClientSession(cookies=cookies, timeout=aiohttp.ClientTimeout(total=None))
        try:
            resp = await http.request(method, url, headers=headers, json=json)
        except BaseException:
            await http.close()
            raise
        if resp.status != 200 or "text/event-stream" not in resp.headers.get("Content-Type", ""):
            body = await resp.text()
            resp.release()
            await http.close()
            raise AssertionError(f"not an event stream: {resp.status} {body[:300]}")
        reader = cls(http, resp)
        reader.task = asyncio.create_task(reader._read())
        return reader

    async def _read(self) -> None:
        current = Frame()
        data: list[str] = []
        try:
            async for raw in self.resp.content:
                line = raw.decode().rstrip("\r\n")
                if line == "":
                    if data or current.event != "message" or current.id is not None:
                        current.data = "\n".join(data)
                        self.frames.append(current)
                    current, data = Frame(), []
                elif line.startswith(":"):
                    self.frames.append(Frame(event="", data=line[1:].strip(), comment=True))
                else:
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "event":
                        current.event = value
                    elif name == "data":
                        data.append(value)
                    elif name == "id":
                        current.id = value
                self.changed.set()
        except (aiohttp.ClientError, asyncio.CancelledError):
            pass
        finally:
            self.ended.set()
            self.changed.set()

    async def wait(
        self, pred: Callable[[Frame], bool], timeout: float = 10.0, *, after: int = 0
    ) -> Frame:
        """The first frame from index `after` on that matches."""
        deadline = time.monotonic() + timeout
        seen = after
        while True:
            for frame in self.frames[seen:]:
                if pred(frame):
                    return frame
            seen = len(self.frames)
            if self.ended.is_set():
                raise AssertionError(f"the stream ended first; frames: {self.frames[-5:]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no such frame in {timeout}s; frames: {self.frames[-5:]}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass

    async def wait_ended(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self.ended.wait(), timeout)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.resp.release()
        await self.http.close()

    async def __aenter__(self) -> SseReader:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
