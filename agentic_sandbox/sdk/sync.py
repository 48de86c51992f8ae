"""`Client`: the same API as `AsyncClient`, for code without an event loop.

    with Client() as sbx:
        inst = sbx.instances.wait_ready(sbx.instances.create("dev-1"))

How: each `Client` owns one asyncio loop in a daemon thread, and its `AsyncClient` lives
there. A sync method submits the async method's coroutine to that loop and waits for the
answer; an async iterator (attach, events) becomes an iterator that fetches one item at a
time the same way. So there is one implementation of every call, the aiohttp session is
reused across calls, and a `Client` works inside a program that runs its own loop too (in
another thread). The facades below only name which async methods they carry (`synced`),
keeping their signatures for type checkers. A `Client` may be used from several threads.
Callbacks (an operation's `progress`) run on the client's thread: they must not call the
client.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from agentic_sandbox.sdk.access import AsyncApiKeys, AsyncSecrets, AsyncTokens
from agentic_sandbox.sdk.agentcards import AsyncAgentCards
from agentic_sandbox.sdk.attach import Attachment as AsyncAttachment
from agentic_sandbox.sdk.attach import Resync
from agentic_sandbox.sdk.client import AsyncClient
from agentic_sandbox.sdk.contexts import Credentials
from agentic_sandbox.sdk.files import AsyncFiles
from agentic_sandbox.sdk.fleet import (
    AsyncAgents,
    AsyncHosts,
    AsyncImages,
    AsyncInstances,
    AsyncLoadouts,
    AsyncPools,
    AsyncSnapshots,
)
from agentic_sandbox.sdk.models import Output, SessionExit
from agentic_sandbox.sdk.observe import AsyncAudit, AsyncEvents
from agentic_sandbox.sdk.operations import AsyncOperations
from agentic_sandbox.sdk.ports import PortForward as AsyncPortForward
from agentic_sandbox.sdk.ports import Tunnel as AsyncTunnel
from agentic_sandbox.sdk.sessions import AsyncSessions
from agentic_sandbox.sdk.tasks import AsyncTasks

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")
A = TypeVar("A")
F = TypeVar("F", bound="_Facade[Any]")


class _LoopThread:
    """An event loop running in a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="agentic-sandbox-client", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a Client was called from its own callback; use AsyncClient")
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("this Client is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C in the caller's thread ends the call on the loop too
            raise

    def iterate(self, source: AsyncIterator[T]) -> Iterator[T]:
        async def step() -> tuple[bool, T | None]:
            try:
                return True, await source.__anext__()
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self.run(step())
                if not more:
                    return
                yield item  # type: ignore[misc]
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None and not self.loop.is_closed():
                self.run(aclose())

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class _Facade(Generic[A]):
    """The sync face of one async object: its methods run on the client's loop."""

    def __init__(self, target: A, loop: _LoopThread) -> None:
        self._async = target
        self._loop = loop


class _Carried(Generic[P, R]):
    """A descriptor carrying an async method over to a facade: shown with the method's doc
    and its signature less `self`; bound to the facade's async object, and `_finish` turns
    what the method returns into what the blocking caller gets."""

    def __init__(self, method: Callable[Concatenate[Any, P], Any]) -> None:
        self._method = method
        self.__doc__ = method.__doc__
        sig = inspect.signature(method)
        self.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])

    def _finish(self, result: Any, loop: _LoopThread) -> R:
        raise NotImplementedError

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: _Facade[Any], owner: type) -> Callable[P, R]: ...
    def __get__(self, obj: _Facade[Any] | None, owner: type) -> Any:
        if obj is None:
            return self
        method, target, loop = self._method, obj._async, obj._loop

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return self._finish(method(target, *args, **kwargs), loop)

        functools.update_wrapper(call, method)
        call.__signature__ = self.__signature__  # type: ignore[attr-defined]
        return call


class synced(_Carried[P, T]):
    """`name = synced(AsyncThing.name)`: the coroutine method as a blocking one."""

    def __init__(self, method: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]) -> None:
        super().__init__(method)

    def _finish(self, result: Any, loop: _LoopThread) -> T:
        return loop.run(result)


class synced_iter(_Carried[P, Iterator[T]]):
    """`name = synced_iter(AsyncThing.name)`: the async iterator method as an iterator."""

    def __init__(self, method: Callable[Concatenate[Any, P], AsyncIterator[T]]) -> None:
        super().__init__(method)

    def _finish(self, result: Any, loop: _LoopThread) -> Iterator[T]:
        return loop.iterate(result)


class _synced_wrap(_Carried[P, F]):
    """A plain method that returns an async object, returning its sync facade instead."""

    def __init__(self, method: Callable[Concatenate[Any, P], Any], facade: type[F]) -> None:
        super().__init__(method)
        self._facade = facade

    def _finish(self, result: Any, loop: _LoopThread) -> F:
        return self._facade(result, loop)


class Attachment(_Facade[AsyncAttachment]):
    """A session's terminal: `with`, iterate for `(offset, bytes)`, `send`, `resize`."""

    connect = synced(AsyncAttachment.connect)
    close = synced(AsyncAttachment.close)
    send = synced(AsyncAttachment.send)
    resize = synced(AsyncAttachment.resize)
    signal = synced(AsyncAttachment.signal)
    request_control = synced(AsyncAttachment.request_control)
    release_control = synced(AsyncAttachment.release_control)

    def __enter__(self) -> Attachment:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Output]:
        return self._loop.iterate(self._async)

    @property
    def next_offset(self) -> int | None:
        return self._async.next_offset

    @property
    def exit(self) -> SessionExit | None:
        return self._async.exit

    @property
    def role(self) -> str | None:
        return self._async.role

    @property
    def resyncs(self) -> list[Resync]:
        return self._async.resyncs

    @property
    def connects(self) -> int:
        return self._async.connects


class Tunnel(_Facade[AsyncTunnel]):
    """One TCP connection to a port in the instance: `read`, `write`, `write_eof`, `close`."""

    read = synced(AsyncTunnel.read)
    write = synced(AsyncTunnel.write)
    write_eof = synced(AsyncTunnel.write_eof)
    close = synced(AsyncTunnel.close)

    def __enter__(self) -> Tunnel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def error(self) -> str:
        return self._async.error


class PortForward(_Facade[AsyncPortForward]):
    """A forward from 127.0.0.1 (`address`), served on the client's loop until `close()`."""

    close = synced(AsyncPortForward.close)

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return self._async.address

    @property
    def connections(self) -> int:
        return self._async.connections

    @property
    def failures(self) -> list[str]:
        return self._async.failures


class _synced_facade(_Carried[P, F]):
    """A coroutine method that returns an async object, returning its sync facade."""

    def __init__(
        self, method: Callable[Concatenate[Any, P], Coroutine[Any, Any, Any]], facade: type[F]
    ) -> None:
        super().__init__(method)
        self._facade = facade

    def _finish(self, result: Any, loop: _LoopThread) -> F:
        return self._facade(loop.run(result), loop)


class Operations(_Facade[AsyncOperations]):
    get = synced(AsyncOperations.get)
    list = synced(AsyncOperations.list)
    cancel = synced(AsyncOperations.cancel)
    wait = synced(AsyncOperations.wait)


class Files(_Facade[AsyncFiles]):
    stat = synced(AsyncFiles.stat)
    list = synced(AsyncFiles.list)
    mkdir = synced(AsyncFiles.mkdir)
    remove = synced(AsyncFiles.remove)
    upload = synced(AsyncFiles.upload)
    download = synced(AsyncFiles.download)
    chunks = synced_iter(AsyncFiles.chunks)


class Instances(_Facade[AsyncInstances]):
    def __init__(self, target: AsyncInstances, loop: _LoopThread) -> None:
        super().__init__(target, loop)
        self.files = Files(target.files, loop)

    create = synced(AsyncInstances.create)
    list = synced(AsyncInstances.list)
    get = synced(AsyncInstances.get)
    delete = synced(AsyncInstances.delete)
    action = synced(AsyncInstances.action)
    start = synced(AsyncInstances.start)
    stop = synced(AsyncInstances.stop)
    restart = synced(AsyncInstances.restart)
    force_off = synced(AsyncInstances.force_off)
    suspend = synced(AsyncInstances.suspend)
    resume = synced(AsyncInstances.resume)
    clone = synced(AsyncInstances.clone)
    console = synced(AsyncInstances.console)
    egress = synced(AsyncInstances.egress)
    set_egress = synced(AsyncInstances.set_egress)
    exec = synced(AsyncInstances.exec)
    exec_stream = synced_iter(AsyncInstances.exec_stream)
    tunnel = _synced_facade(AsyncInstances.tunnel, Tunnel)
    port_forward = _synced_facade(AsyncInstances.port_forward, PortForward)

    def proxy_url(self, instance_id: str, port: int, path: str = "/") -> str:
        return self._async.proxy_url(instance_id, port, path)

    wait_ready = synced(AsyncInstances.wait_ready)
    register_host = synced(AsyncInstances.register_host)
    enrollment_token = synced(AsyncInstances.enrollment_token)


class Snapshots(_Facade[AsyncSnapshots]):
    create = synced(AsyncSnapshots.create)
    list = synced(AsyncSnapshots.list)
    revert = synced(AsyncSnapshots.revert)
    delete = synced(AsyncSnapshots.delete)


class Pools(_Facade[AsyncPools]):
    create = synced(AsyncPools.create)
    list = synced(AsyncPools.list)
    delete = synced(AsyncPools.delete)


class Images(_Facade[AsyncImages]):
    build = synced(AsyncImages.build)
    list = synced(AsyncImages.list)
    delete = synced(AsyncImages.delete)


class Hosts(_Facade[AsyncHosts]):
    add = synced(AsyncHosts.add)
    list = synced(AsyncHosts.list)
    get = synced(AsyncHosts.get)
    drain = synced(AsyncHosts.drain)
    undrain = synced(AsyncHosts.undrain)
    remove = synced(AsyncHosts.remove)
    libvirtd_certificate = synced(AsyncHosts.libvirtd_certificate)


class Loadouts(_Facade[AsyncLoadouts]):
    list = synced(AsyncLoadouts.list)
    get = synced(AsyncLoadouts.get)
    apply = synced(AsyncLoadouts.apply)
    versions = synced(AsyncLoadouts.versions)
    activate = synced(AsyncLoadouts.activate)


class Agents(_Facade[AsyncAgents]):
    list = synced(AsyncAgents.list)
    get = synced(AsyncAgents.get)
    bundles = synced(AsyncAgents.bundles)
    upload_bundle = synced(AsyncAgents.upload_bundle)
    rollout = synced(AsyncAgents.rollout)


class Sessions(_Facade[AsyncSessions]):
    create = synced(AsyncSessions.create)
    list = synced(AsyncSessions.list)
    get = synced(AsyncSessions.get)
    kill = synced(AsyncSessions.kill)
    signal = synced(AsyncSessions.signal)
    screen = synced(AsyncSessions.screen)
    recording = synced(AsyncSessions.recording)
    attach = _synced_wrap(AsyncSessions.attach, Attachment)


class Tasks(_Facade[AsyncTasks]):
    send = synced(AsyncTasks.send)
    list = synced(AsyncTasks.list)
    get = synced(AsyncTasks.get)
    cancel = synced(AsyncTasks.cancel)
    wait = synced(AsyncTasks.wait)
    logs = synced_iter(AsyncTasks.logs)


class Events(_Facade[AsyncEvents]):
    page = synced(AsyncEvents.page)
    iter = synced_iter(AsyncEvents.iter)
    follow = synced_iter(AsyncEvents.follow)


class Audit(_Facade[AsyncAudit]):
    page = synced(AsyncAudit.page)
    iter = synced_iter(AsyncAudit.iter)


class Tokens(_Facade[AsyncTokens]):
    create = synced(AsyncTokens.create)
    list = synced(AsyncTokens.list)
    revoke = synced(AsyncTokens.revoke)
    whoami = synced(AsyncTokens.whoami)


class ApiKeys(_Facade[AsyncApiKeys]):
    create = synced(AsyncApiKeys.create)
    list = synced(AsyncApiKeys.list)
    revoke = synced(AsyncApiKeys.revoke)


class Secrets(_Facade[AsyncSecrets]):
    set = synced(AsyncSecrets.set)
    list = synced(AsyncSecrets.list)
    delete = synced(AsyncSecrets.delete)


class AgentCards(_Facade[AsyncAgentCards]):
    get = synced(AsyncAgentCards.get)
    jwks = synced(AsyncAgentCards.jwks)
    verify = synced(AsyncAgentCards.verify)


class Client(_Facade[AsyncClient]):
    """The blocking client; see `AsyncClient` for the arguments and the module doc for how."""

    whoami = synced(AsyncClient.whoami)

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        context: str | None = None,
        timeout: float = 60.0,
        credentials: Credentials | None = None,
    ) -> None:
        target = AsyncClient(url, token, context=context, timeout=timeout, credentials=credentials)
        super().__init__(target, _LoopThread())
        loop = self._loop
        self.credentials = target.credentials
        self.operations = Operations(target.operations, loop)
        self.instances = Instances(target.instances, loop)
        self.snapshots = Snapshots(target.snapshots, loop)
        self.pools = Pools(target.pools, loop)
        self.images = Images(target.images, loop)
        self.hosts = Hosts(target.hosts, loop)
        self.loadouts = Loadouts(target.loadouts, loop)
        self.agents = Agents(target.agents, loop)
        self.sessions = Sessions(target.sessions, loop)
        self.tasks = Tasks(target.tasks, loop)
        self.events = Events(target.events, loop)
        self.audit = Audit(target.audit, loop)
        self.tokens = Tokens(target.tokens, loop)
        self.api_keys = ApiKeys(target.api_keys, loop)
        self.secrets = Secrets(target.secrets, loop)
        self.agentcards = AgentCards(target.agentcards, loop)

    @property
    def url(self) -> str:
        return self.credentials.url

    def close(self) -> None:
        """Close the HTTP session and stop the client's thread."""
        if not self._loop.loop.is_closed():
            self._loop.run(self._async.close())
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
