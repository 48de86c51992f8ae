"""The session keeper: the agent's first process, which holds every PTY while workers come and go.

`agent-client` starts as the keeper (standard library only, no gRPC, no event loop), which
runs the agent proper — the *worker* — as its child and restarts it when it exits: a crash, a
`kill -9`, or a planned restart (`SIGHUP` to the keeper, or an upgrade: the worker exits with
`EXIT_RESTART` and the new worker runs whatever code is on disk then). So an agent restart no
longer ends the sessions it holds:

- The worker hands the keeper, over a `SOCK_SEQPACKET` socket pair (`AGENTIC_SANDBOX_KEEPER_FD`),
  a copy of each session's PTY master and of its output ring (a memfd, `ring.py`) with what is
  needed to take the session on again (`hold`); `release` when the session is over. The copies
  keep the terminals open — a PTY whose last master closes hangs up its processes — and the
  rings hold every byte the server has not acknowledged, so nothing is lost across a worker's
  `kill -9`.
- The keeper is a child subreaper: sessions of a worker that died become its children, it
  reaps them and keeps their exit status.
- A new worker receives every held session first (`adopt` messages with the descriptors, then
  `ready`), takes them on with their rings and reports them in its registration as before;
  exits the keeper reaps later reach it as `exited`.

Why one keeper and not a holder process per session (what the seed did with tmux's server, a
single process too): a Python holder costs ~25 ms to start on the host (~10x in a TCG guest) and
~10 MB of memory for every session; the keeper costs that once. It does no per-byte work: the
worker reads and writes the PTYs itself, as before.

`SIGTERM`/`SIGINT` to the keeper stop the worker (it ends its sessions, as an agent stop always
did) and then the keeper. Killing the keeper's process group kills both; the sessions hang up.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

ENV_FD = "AGENTIC_SANDBOX_KEEPER_FD"
EXIT_RESTART = 75  # the worker asks to be started again (an upgrade, a planned restart)
MAX_MESSAGE = 64 * 1024
PR_SET_CHILD_SUBREAPER = 36
RESTART_BACKOFF = (0.1, 5.0)  # a worker that keeps failing at once is restarted slower


def _log(msg: str) -> None:
    ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(
        json.dumps({"time": ts, "level": "info", "logger": "keeper", "msg": msg}),
        file=sys.stderr,
        flush=True,
    )


def exit_status(status: int, rusage: Any) -> dict[str, Any]:
    """A wait status as the worker reports it (code or signal name, CPU time, peak memory)."""
    code = os.waitstatus_to_exitcode(status)
    out: dict[str, Any] = {"code": code if code >= 0 else None, "signal": ""}
    if code < 0:
        try:
            out["signal"] = signal.Signals(-code).name.removeprefix("SIG")
        except ValueError:
            out["signal"] = str(-code)
    if rusage is not None:
        out["cpu_us"] = int((rusage.ru_utime + rusage.ru_stime) * 1_000_000)
        out["maxrss_kb"] = int(rusage.ru_maxrss)
    return out


@dataclass
class Held:
    sid: str
    pid: int
    fds: list[int]  # the PTY master, the ring's memfd
    meta: dict[str, Any]
    exit: dict[str, Any] | None = None  # reaped by the keeper


@dataclass
class Keeper:
    argv: list[str]  # the worker's command line
    held: dict[str, Held] = field(default_factory=dict)
    worker: subprocess.Popen[bytes] | None = None
    sock: socket.socket | None = None
    stopping: bool = False
    code: int = 0
    _started_at: float = 0.0
    _backoff: float = RESTART_BACKOFF[0]

    def run(self) -> int:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        pending: list[int] = []
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: pending.append(s))
        while True:
            if self.worker is None:
                if self.stopping:
                    break
                self._start_worker()
            readers = [wake_r] + ([self.sock] if self.sock is not None else [])
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select(readers, [], [], 1.0)
                if wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                if self.sock is not None and self.sock in ready:
                    self._receive()
            while pending:
                self._on_signal(pending.pop(0))
        for h in self.held.values():
            for fd in h.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return self.code

    # ---- the worker ---------------------------------------------------------------------------
    def _start_worker(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, **{ENV_FD: str(theirs.fileno())})
        self.worker = subprocess.Popen(self.argv, env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.sock = mine
        self._started_at = time.monotonic()
        for h in list(self.held.values()):
            self._send(
                {"op": "adopt", "sid": h.sid, "pid": h.pid, "meta": h.meta, "exit": h.exit}, h.fds
            )
        self._send({"op": "ready"})

    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        if self.sock is None:
            return
        try:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], fds or [])
        except OSError as exc:
            _log(f"cannot reach the worker: {exc}")

    def _receive(self) -> None:
        assert self.sock is not None
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 8)
        except OSError:
            data, fds = b"", []
        if not data:  # the worker is gone (its exit arrives as SIGCHLD)
            self.sock.close()
            self.sock = None
            return
        try:
            msg = json.loads(data)
            op, sid = msg.get("op"), str(msg.get("sid", ""))
        except (ValueError, AttributeError):
            op, sid = None, ""
        if op == "hold" and sid and len(fds) == 2:
            old = self.held.pop(sid, None)
            if old is not None:
                self._close(old)
            self.held[sid] = Held(
                sid, int(msg.get("pid", 0)), list(fds), dict(msg.get("meta") or {})
            )
            return
        for fd in fds:
            os.close(fd)
        if op == "release" and sid in self.held:
            self._close(self.held.pop(sid))

    @staticmethod
    def _close(h: Held) -> None:
        for fd in h.fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _on_signal(self, sig: int) -> None:
        if sig == signal.SIGCHLD:
            self._reap()
        elif sig in (signal.SIGTERM, signal.SIGINT):
            self.stopping = True
            if self.worker is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.worker.send_signal(sig)
        elif sig == signal.SIGHUP and self.worker is not None:
            _log("restarting the worker (SIGHUP); sessions are kept")
            with contextlib.suppress(ProcessLookupError):
                self.worker.send_signal(signal.SIGHUP)

    def _reap(self) -> None:
        while True:
            try:
                pid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.worker is not None and pid == self.worker.pid:
                self.worker.returncode = os.waitstatus_to_exitcode(status)
                self._worker_exited(self.worker.returncode)
                continue
            for h in self.held.values():
                if h.pid == pid and h.exit is None:
                    h.exit = exit_status(status, rusage)
                    self._send({"op": "exited", "sid": h.sid, "exit": h.exit})

    def _worker_exited(self, code: int) -> None:
        self.worker = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.stopping:
            self.code = code if code >= 0 else 128 - code
            return
        quick = time.monotonic() - self._started_at < 10.0
        if code == EXIT_RESTART:
            _log("the worker asked to be restarted; sessions are kept")
            self._backoff = RESTART_BACKOFF[0]
            return
        _log(f"the worker exited ({code}); restarting it, {len(self.held)} sessions kept")
        if quick:
            time.sleep(self._backoff)
            self._backoff = min(RESTART_BACKOFF[1], self._backoff * 2)
        else:
            self._backoff = RESTART_BACKOFF[0]


@dataclass
class Adopted:
    """A session a previous worker left with the keeper."""

    sid: str
    pid: int
    master_fd: int
    ring_fd: int
    meta: dict[str, Any]
    exit: dict[str, Any] | None


class KeeperLink:
    """The worker's side: hand sessions over, take them back, hear of their exits."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(5.0)  # the keeper answers at once; a stuck one is given up
        self.alive = True

    @classmethod
    def from_env(cls) -> KeeperLink | None:
        """In a worker: the link to its keeper (None when the agent runs without one)."""
        raw = os.environ.pop(ENV_FD, "")
        if not raw.isdigit():
            return None
        try:
            return cls(socket.socket(fileno=int(raw)))
        except OSError:
            return None

    def fileno(self) -> int:
        return self.sock.fileno()

    def adopted(self) -> list[Adopted]:
        """Every session the keeper holds (sent first, up to `ready`)."""
        out: list[Adopted] = []
        while True:
            msg, fds = self._recv()
            if msg is None or msg.get("op") == "ready":
                return out
            if msg.get("op") == "adopt" and len(fds) == 2:
                out.append(
                    Adopted(
                        str(msg["sid"]),
                        int(msg["pid"]),
                        fds[0],
                        fds[1],
                        dict(msg.get("meta") or {}),
                        msg.get("exit"),
                    )
                )
            else:
                for fd in fds:
                    os.close(fd)

    def notices(self) -> list[dict[str, Any]]:
        """What the keeper said since (non-blocking): `exited` of adopted sessions."""
        out: list[dict[str, Any]] = []
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    msg, fds = self._recv()
                except BlockingIOError:
                    break
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    break
                out.append(msg)
        finally:
            self.sock.settimeout(5.0)
        return out

    def hold(self, sid: str, pid: int, fds: list[int], meta: dict[str, Any]) -> None:
        self._send({"op": "hold", "sid": sid, "pid": pid, "meta": meta}, fds)

    def release(self, sid: str) -> None:
        self._send({"op": "release", "sid": sid}, [])

    def _send(self, msg: dict[str, Any], fds: list[int]) -> None:
        if not self.alive:
            return
        try:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], fds)
        except OSError:
            self.alive = False  # the keeper is gone: sessions end with this worker, as before

    def _recv(self) -> tuple[dict[str, Any] | None, list[int]]:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 8)
        except BlockingIOError:
            raise
        except OSError:
            self.alive = False
            return None, []
        if not data:
            self.alive = False
            return None, fds
        try:
            msg = json.loads(data)
        except ValueError:
            return {}, fds
        return (msg if isinstance(msg, dict) else {}), fds


def run_keeper(argv: list[str]) -> int:
    return Keeper(argv).run()
