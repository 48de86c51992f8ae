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

Agent bundles (`upgrade.py`): the keeper starts its worker from `<state_dir>/bundles/current`
when that names an unpacked bundle (`PYTHONPATH` first, `python -P`: the current directory
never shadows it), else from the installed agent. A worker that unpacked a new bundle asks for a
`trial` of it and exits as for a planned restart; the keeper starts the next worker from the
bundle and makes it `current` once that worker says `healthy`. One that exits before, or is
not healthy within the trial's seconds (it is asked to hand over, then killed), is replaced by
a worker from the bundle that ran before, which is told why (`PROBLEM_ENV`). A `current`
bundle whose worker keeps failing at once is given up for the installed agent the same way.

`SIGTERM`/`SIGINT` to the keeper stop the worker (it ends its sessions, as an agent stop always
did) and then the keeper. Killing the keeper's process group kills both; the sessions hang up.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_FD = "AGENTIC_SANDBOX_KEEPER_FD"
EXIT_RESTART = 75  # the worker asks to be started again (an upgrade, a planned restart)
MAX_MESSAGE = 64 * 1024
PR_SET_CHILD_SUBREAPER = 36
RESTART_BACKOFF = (0.1, 5.0)  # a worker that keeps failing at once is restarted slower
PROBLEM_ENV = "AGENTIC_SANDBOX_BUNDLE_PROBLEM"  # why a bundle was given up, for the next worker
HANDOVER_GRACE = 10.0  # a worker asked to hand over on a failed trial, then killed
CURRENT_GIVE_UP = 3  # quick failures in a row of the current bundle's worker, then the installed


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


def _bundle_dir(bundles: Path | None, digest: str) -> Path | None:
    """`bundles/<digest>` when it holds an unpacked agent (what `upgrade._unpack` made)."""
    if bundles is None or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        return None
    path = bundles / digest
    return path if holds_agent(path) else None


def holds_agent(root: Path) -> bool:
    """Whether `root` is an unpacked bundle: the agent's entry point is there."""
    return (root / "agentic_sandbox" / "agent" / "main.py").is_file()


@dataclass
class Trial:
    digest: str
    seconds: float
    fallback: Path | None  # what ran before (None: the installed agent)
    deadline: float = 0.0  # set when its worker starts
    failed: str = ""  # why it is being ended


@dataclass
class Keeper:
    argv: list[str]  # the worker's command line
    bundles: Path | None = None  # <state_dir>/bundles
    held: dict[str, Held] = field(default_factory=dict)
    bundle: Path | None = None  # the bundle workers run (None: the installed agent)
    trial: Trial | None = None
    wanted: Trial | None = None  # asked for by the worker: started with the next one
    problem: str = ""  # told to the next worker: why a bundle was given up
    _quick_failures: int = 0
    _kill_at: float = 0.0
    worker: subprocess.Popen[bytes] | None = None
    sock: socket.socket | None = None
    stopping: bool = False
    code: int = 0
    _started_at: float = 0.0
    _backoff: float = RESTART_BACKOFF[0]

    def run(self) -> int:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.bundle = self._current()
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
            self._check_trial()
        for h in self.held.values():
            for fd in h.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return self.code

    # ---- bundles ------------------------------------------------------------------------------
    def _current(self) -> Path | None:
        if self.bundles is None:
            return None
        try:
            digest = os.readlink(self.bundles / "current")
        except OSError:
            return None
        found = _bundle_dir(self.bundles, digest)
        if found is None:
            _log(f"bundles/current names {digest!r}, which holds no agent: the installed one runs")
        return found

    def _make_current(self, bundle: Path | None, before: Path | None = None) -> None:
        """Record `bundle` as current (None: the installed agent); prune all bundles but it
        and `before`."""
        if self.bundles is None:
            return
        link = self.bundles / "current"
        try:
            if bundle is None:
                with contextlib.suppress(FileNotFoundError):
                    link.unlink()
                return
            tmp = self.bundles / f".current.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.symlink(bundle.name, tmp)
            os.replace(tmp, link)
        except OSError as exc:
            _log(f"cannot record the current bundle: {exc}")
            return
        keep = {bundle.name, *((before.name,) if before is not None else ())}
        for old in self.bundles.iterdir():
            if len(old.name) == 64 and old.name not in keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def _on_healthy(self) -> None:
        trial = self.trial
        if trial is None or trial.failed:
            return
        _log(f"agent bundle {trial.digest[:12]} is healthy: it is the current bundle now")
        self._make_current(self.bundle, trial.fallback)
        self.trial = None
        self.problem = ""
        self._quick_failures = 0

    def _check_trial(self) -> None:
        trial, now = self.trial, time.monotonic()
        if trial is None or self.worker is None:
            return
        if not trial.failed and now > trial.deadline:
            trial.failed = f"was not healthy within {trial.seconds:.0f} s"
            _log(f"agent bundle {trial.digest[:12]} {trial.failed}: going back")
            self._kill_at = now + HANDOVER_GRACE
            with contextlib.suppress(ProcessLookupError):
                self.worker.send_signal(signal.SIGHUP)  # hand the sessions back, then exit
        elif trial.failed and now > self._kill_at:
            with contextlib.suppress(ProcessLookupError):
                self.worker.kill()

    def _roll_back(self, why: str) -> None:
        trial = self.trial
        assert trial is not None
        self.problem = f"agent bundle {trial.digest} was rolled back: its worker {why}"
        _log(self.problem)
        self.bundle = trial.fallback
        self.trial = None

    # ---- the worker ---------------------------------------------------------------------------
    def _worker_argv(self) -> list[str]:
        if self.bundle is None:
            return self.argv
        return [self.argv[0], "-P", *self.argv[1:]]  # -P: no current directory on the path

    def _worker_env(self, fd: int) -> dict[str, str]:
        env = dict(os.environ, **{ENV_FD: str(fd)})
        if self.bundle is not None:
            rest = env.get("PYTHONPATH", "")
            env["PYTHONPATH"] = str(self.bundle) + (os.pathsep + rest if rest else "")
        if self.problem:
            env[PROBLEM_ENV] = self.problem
        return env

    def _start_worker(self) -> None:
        if self.wanted is not None:  # the worker that asked for a trial is gone: start it
            trial, self.wanted = self.wanted, None
            found = _bundle_dir(self.bundles, trial.digest)
            if found is not None:
                self.trial = trial
                self.bundle = found
                _log(f"trying agent bundle {trial.digest[:12]} ({trial.seconds:.0f} s)")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = self._worker_env(theirs.fileno())
        self.worker = subprocess.Popen(self._worker_argv(), env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.sock = mine
        self._started_at = time.monotonic()
        if self.trial is not None and not self.trial.deadline:
            self.trial.deadline = self._started_at + self.trial.seconds
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
        elif op == "healthy":
            self._on_healthy()
        elif op == "trial":
            digest = str(msg.get("bundle", ""))
            seconds = msg.get("seconds")
            seconds = float(seconds) if isinstance(seconds, int | float) else 120.0
            if _bundle_dir(self.bundles, digest) is None:
                _log(f"a trial of {digest[:64]!r} was asked for, which is not unpacked")
            else:
                self.wanted = Trial(digest, min(max(seconds, 5.0), 3600.0), self.bundle)

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

    def _drain(self) -> None:
        """What the worker said before it exited (a `trial` it asked for just before)."""
        while self.sock is not None and select.select([self.sock], [], [], 0)[0]:
            self._receive()

    def _worker_exited(self, code: int) -> None:
        self._drain()
        self.worker = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.stopping:
            self.code = code if code >= 0 else 128 - code
            return
        quick = time.monotonic() - self._started_at < 10.0
        trial = self.trial
        if trial is not None and (trial.failed or code != EXIT_RESTART):
            self._roll_back(trial.failed or f"exited ({code}) before it was healthy")
            return
        if code == EXIT_RESTART:
            _log("the worker asked to be restarted; sessions are kept")
            self._backoff = RESTART_BACKOFF[0]
            return
        self._quick_failures = self._quick_failures + 1 if quick else 0
        if self.bundle is not None and self._quick_failures >= CURRENT_GIVE_UP:
            self.problem = (
                f"agent bundle {self.bundle.name} was given up: its worker exited ({code}) "
                f"{self._quick_failures} times in a row at once; the installed agent runs"
            )
            _log(self.problem)
            self.bundle = None
            self._make_current(None)
            self._quick_failures = 0
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

    def trial(self, digest: str, seconds: int) -> None:
        """Start the next worker from bundle `digest` (unpacked), on trial for `seconds`."""
        self._send({"op": "trial", "bundle": digest, "seconds": seconds}, [])

    def healthy(self) -> None:
        """This worker linked and heard the server: a bundle on trial is kept."""
        self._send({"op": "healthy"}, [])

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


def run_keeper(argv: list[str], bundles: Path | None = None) -> int:
    return Keeper(argv, bundles).run()
