"""libvirt's event loop on the server's asyncio loop (``libvirtaio``), safe for threads.

``libvirtaio.virEventAsyncIOImpl`` calls ``loop.add_reader``/``remove_reader`` and starts timer
tasks directly from whichever thread libvirt calls it on. The fleet runs blocking libvirt calls in
executor threads, and libvirt's RPC client updates its socket watch from the calling thread, so
those calls would touch the loop from a foreign thread (undefined for asyncio, fatal for uvloop).

`LoopBridge` is a ``virEventAsyncIOImpl`` whose six callbacks only record the wanted watches and
timers (under a lock) and hand the loop work to the loop thread through
``call_soon_threadsafe``; each deferred step re-reads the current wanted state, so their order
does not matter. Dispatch runs on the loop thread. The bridge is registered with libvirt once per
process (``virEventRegisterImpl`` cannot be undone) and can be re-attached to a new loop when it
is idle (tests run one loop per test).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import libvirt
import libvirtaio

log = logging.getLogger(__name__)

_READ = libvirt.VIR_EVENT_HANDLE_READABLE
_WRITE = libvirt.VIR_EVENT_HANDLE_WRITABLE


@dataclass
class _Watch:
    iden: int
    fd: int
    event: int
    cb: Callable[..., Any]
    opaque: Any


@dataclass
class _Timer:
    iden: int
    timeout: int
    cb: Callable[..., Any]
    opaque: Any
    removed: bool = False
    handle: asyncio.TimerHandle | None = field(default=None, repr=False)


class LoopBridge(libvirtaio.virEventAsyncIOImpl):
    loop: asyncio.AbstractEventLoop
    _instance: LoopBridge | None = None
    _ids = itertools.count(1)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._lock = threading.RLock()
        self._watches: dict[int, _Watch] = {}
        self._timers: dict[int, _Timer] = {}
        self._fd_state: dict[int, tuple[bool, bool]] = {}

    # ------------------------------------------------------------------ process-wide

    @classmethod
    def attach(cls, loop: asyncio.AbstractEventLoop) -> LoopBridge:
        """Make libvirt dispatch its events on ``loop`` (registering with libvirt once)."""
        if cls._instance is None:
            bridge = cls(loop)
            libvirt.virEventRegisterImpl(
                bridge._add_handle,
                bridge._update_handle,
                bridge._remove_handle,
                bridge._add_timeout,
                bridge._update_timeout,
                bridge._remove_timeout,
            )
            libvirtaio._current_impl = bridge
            # errors reach callers as exceptions; don't also print them to stderr
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            cls._instance = bridge
            return bridge
        bridge = cls._instance
        if bridge.loop is not loop:
            bridge._move_to(loop)
        return bridge

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self.loop
        with self._lock:
            if not old.is_closed() and old.is_running():
                log.warning("libvirt event loop moved while the previous loop still runs")
            self.loop = loop
            self._fd_state.clear()
            fds = {w.fd for w in self._watches.values()}
            timers = list(self._timers.values())
            for t in timers:
                t.handle = None
        for fd in fds:
            self._defer(self._sync_fd, fd)
        for t in timers:
            self._defer(self._sync_timer, t)

    # ------------------------------------------------------------------ plumbing

    def _defer(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self.loop
        if loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed in between
            pass

    def _free(self, opaque: Any) -> None:
        libvirt.virEventInvokeFreeCallback(opaque)

    # ------------------------------------------------------------------ handles

    def _add_handle(self, fd: int, event: int, cb: Any, opaque: Any) -> int:
        iden = next(self._ids)
        with self._lock:
            self._watches[iden] = _Watch(iden, fd, event, cb, opaque)
        self._defer(self._sync_fd, fd)
        return iden

    def _update_handle(self, watch: int, event: int) -> None:
        with self._lock:
            w = self._watches.get(watch)
            if w is None:
                return
            w.event = event
            fd = w.fd
        self._defer(self._sync_fd, fd)

    def _remove_handle(self, watch: int) -> int:
        with self._lock:
            w = self._watches.pop(watch, None)
        if w is None:
            return -1
        self._defer(self._sync_fd, w.fd)
        self._defer(self._free, w.opaque)
        return 0

    def _sync_fd(self, fd: int) -> None:
        with self._lock:
            ws = [w for w in self._watches.values() if w.fd == fd]
            want = (any(w.event & _READ for w in ws), any(w.event & _WRITE for w in ws))
            have = self._fd_state.get(fd, (False, False))
            if want == have and ws:
                return
            if ws:
                self._fd_state[fd] = want
            else:
                self._fd_state.pop(fd, None)
        loop = self.loop
        if want[0]:
            loop.add_reader(fd, self._dispatch, fd, _READ)
        else:
            loop.remove_reader(fd)
        if want[1]:
            loop.add_writer(fd, self._dispatch, fd, _WRITE)
        else:
            loop.remove_writer(fd)

    def _dispatch(self, fd: int, event: int) -> None:
        with self._lock:
            ws = [w for w in self._watches.values() if w.fd == fd and w.event & event]
        for w in ws:
            try:
                w.cb(w.iden, fd, event, w.opaque)
            except Exception:  # pragma: no cover - libvirt callbacks should not raise
                log.exception("libvirt handle callback failed")

    # ------------------------------------------------------------------ timers

    def _add_timeout(self, timeout: int, cb: Any, opaque: Any) -> int:
        iden = next(self._ids)
        t = _Timer(iden, timeout, cb, opaque)
        with self._lock:
            self._timers[iden] = t
        self._defer(self._sync_timer, t)
        return iden

    def _update_timeout(self, timer: int, timeout: int) -> None:
        with self._lock:
            t = self._timers.get(timer)
            if t is None:
                return
            t.timeout = timeout
        self._defer(self._sync_timer, t)

    def _remove_timeout(self, timer: int) -> int:
        with self._lock:
            t = self._timers.pop(timer, None)
            if t is None:
                return -1
            t.removed = True
        self._defer(self._sync_timer, t)
        self._defer(self._free, t.opaque)
        return 0

    def _sync_timer(self, t: _Timer) -> None:
        with self._lock:
            if t.handle is not None:
                t.handle.cancel()
                t.handle = None
            if t.removed or t.timeout < 0:
                return
            t.handle = self.loop.call_later(t.timeout / 1000.0, self._fire, t)

    def _fire(self, t: _Timer) -> None:
        with self._lock:
            t.handle = None
            if t.removed or t.timeout < 0:
                return
            t.handle = self.loop.call_later(t.timeout / 1000.0, self._fire, t)
        try:
            t.cb(t.iden, t.opaque)
        except Exception:  # pragma: no cover
            log.exception("libvirt timer callback failed")
