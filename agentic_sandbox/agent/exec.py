"""Exec: one non-interactive command per stream (kind `exec`), with its budget.

Channels: 0 = stdin (from the server; only when `ExecSpec.stdin`, else /dev/null), 1 = stdout,
2 = stderr. The command runs as given (argv, no shell), as the asked user, in its own session
(process group) and its own cgroup (`cgroups.py`).

- **Spawning** is cheap: no Python runs in the child (no `preexec_fn`, which forces a full
  fork of the agent and a Python interpreter between fork and exec: tens of ms). The user
  switch is `Popen`'s own (`user`, `group`, `extra_groups`). With a cgroup, the child starts as
  `/bin/sh` holding on one line of its stdin (`HOLD`); the agent writes its pid into the run's
  cgroups and only then sends the line, and the shell execs the command (same pid, the argv as
  given, the same PATH search as `Popen`'s): nothing of the command runs outside its cgroup.
  What the shell would do differently from `execve` (a missing or non-executable program, a
  file that is no program, which a shell would run as a script) is refused before the spawn.

- **Output**: stdout and stderr are non-blocking pipes read from the event loop only while the
  stream has credit on that channel (`Stream.room`), one chunk at a time: a consumer that falls
  behind stalls the command on its own writes, as a slow pipe would, and nothing piles up here.
- **Stdin**: written to the pipe as it comes; credit goes back as the pipe takes it, so what
  waits here is bounded by the window granted. A command that closes its stdin drops the rest
  (and keeps granting, so the sender is never stuck).
- **The end**: when the main process exits, whatever else is left of the run is killed (a run
  is over when its command is), the pipes are drained to EOF, and the close carries the
  `ExecResult`: exit code or signal, the reason when a budget ended it (`timeout`, `memory`,
  `pids`, `output-limit`; `canceled` when the server cancelled), duration, CPU time, peak memory
  and the bytes written to each stream. Usage comes from the run's cgroup; without one, from the
  exit status's rusage. The cgroup is removed once empty.
- **Link loss or cancel**: the run is killed at once; a lost link sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import pwd
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO

from agentic_sandbox.agent import egress as agent_egress
from agentic_sandbox.agent.cgroups import (
    BudgetRefused,
    Cgroups,
    RunCgroup,
    Usage,
    kill_run,
    measured,
    over_output,
)
from agentic_sandbox.agent.programs import HOLD, SH, program_problem, unignore_terminal_signals
from agentic_sandbox.agent.streams import CHUNK, Stream, StreamRefused
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

STDIN, STDOUT, STDERR = 0, 1, 2
NO_CGROUP_GRACE = 2.0  # without a cgroup, pipes held by escaped processes are given up after this
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_ARGS = 4096
HOLD_NO_STDIN = HOLD + " </dev/null"


@dataclass(frozen=True)
class ExecContext:
    """What every run needs from the agent."""

    cgroups: Cgroups
    default_user: str = ""
    # on top of the user's basic environment, under the request's (the egress proxy settings)
    base_env: dict[str, str] = field(default_factory=dict)
    egress_listen: str = ""  # the guest's egress proxy listener ("": none)


def _account(name: str) -> pwd.struct_passwd:
    if not name:
        return pwd.getpwuid(os.geteuid())
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise StreamRefused("bad-user", f"no such user {name!r}", "user") from None


def _base_env(user: pwd.struct_passwd) -> dict[str, str]:
    return {
        "HOME": user.pw_dir,
        "USER": user.pw_name,
        "LOGNAME": user.pw_name,
        "SHELL": user.pw_shell or "/bin/sh",
        "PATH": PATH,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }


def _spawn(
    argv: list[str],
    *,
    stdin: bool,
    cwd: str,
    env: dict[str, str],
    user: pwd.struct_passwd | None,
    groups: list[int],
    cg: RunCgroup | None,
) -> subprocess.Popen[bytes]:
    """Start the command, in `cg` before it runs (held, see the module's doc)."""
    held = cg is not None
    unignore_terminal_signals()
    proc = subprocess.Popen(
        [SH, "-c", HOLD if stdin else HOLD_NO_STDIN, *argv] if held else argv,
        stdin=subprocess.PIPE if stdin or held else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        user=user.pw_uid if user is not None else None,
        group=user.pw_gid if user is not None else None,
        extra_groups=groups if user is not None else None,
    )
    if cg is None:
        return proc
    assert proc.stdin is not None
    try:
        cg.join(proc.pid)
        os.write(proc.stdin.fileno(), b"\n")
    except OSError as exc:
        proc.kill()  # still held: nothing of the command ran
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        raise StreamRefused("internal", f"cannot put the run in its cgroup: {exc}") from None
    if not stdin:
        proc.stdin.close()
        proc.stdin = None
    return proc


def _nonblocking(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


def _read_some(fd: int, room: int) -> tuple[bytes, bool]:
    """Up to `room` bytes of a non-blocking pipe, read until it is empty, and whether it ended
    (so a command that wrote and exited answers with one frame, not a chunk and then its end)."""
    parts: list[bytes] = []
    n = 0
    eof = False
    while n < room:
        try:
            data = os.read(fd, room - n)
        except BlockingIOError:
            break
        except OSError:
            data = b""
        if not data:
            eof = True
            break
        parts.append(data)
        n += len(data)
    return (parts[0] if len(parts) == 1 else b"".join(parts)), eof


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name.removeprefix("SIG")
    except ValueError:
        return str(num)


class ExecRun:
    """One command on one stream (the stream's handler)."""

    def __init__(
        self,
        stream: Stream,
        spec: pb.ExecSpec,
        proc: subprocess.Popen[bytes],
        cg: RunCgroup | None,
        cgroups: Cgroups | None = None,
    ) -> None:
        self.stream = stream
        self.spec = spec
        self.budget = spec.budget
        self.proc = proc
        self.pid = proc.pid
        self.cgroup = cg
        self.enforcement = cg.enforcement if cg is not None else "none"
        self._loop = asyncio.get_running_loop()
        self._started = time.monotonic()
        self._outputs: dict[int, int] = {}  # channel -> fd, while open
        self._files: dict[int, IO[bytes]] = {}  # fd -> the pipe's file (which closes it)
        self._discard = False  # output is no longer wanted (output limit, cancel): drain it
        self._reading: set[int] = set()
        self.written = {STDOUT: 0, STDERR: 0}
        self._stdin_fd: int | None = None
        self._stdin = bytearray()
        self._stdin_eof = False
        self._stdin_broken = False
        self._writing = False
        self.reason = ""
        self.status: int | None = None
        self.rusage: object | None = None
        self.ended = False
        self._detached = False  # the link is gone: nothing is sent
        self._pidfd: int | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._cgroups = cgroups  # the agent's, to make the next run's spare
        for ch, pipe in ((STDOUT, proc.stdout), (STDERR, proc.stderr)):
            assert pipe is not None
            fd = pipe.fileno()
            _nonblocking(fd)
            self._outputs[ch] = fd
            self._files[fd] = pipe
        if proc.stdin is not None:
            self._stdin_fd = proc.stdin.fileno()
            self._files[self._stdin_fd] = proc.stdin
            _nonblocking(self._stdin_fd)
        if self.budget.timeout_ms:
            self._timers.append(
                self._loop.call_later(self.budget.timeout_ms / 1000.0, self._end, "timeout")
            )
        if cg is not None:
            cg.watch(self._loop, self._end)
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:
            self._timers.append(self._loop.call_later(0.05, self._poll_exit))
        else:
            self._loop.add_reader(self._pidfd, self._on_exit)
        for ch in self._outputs:
            self._flow(ch)

    # ---- starting ----------------------------------------------------------------------------
    @classmethod
    def open(
        cls, ctx: ExecContext, stream: Stream, msg: pb.StreamOpen
    ) -> tuple[ExecRun, pb.StreamAccept]:
        spec = msg.exec
        argv = list(spec.argv)
        if not argv or not argv[0] or len(argv) > MAX_ARGS:
            raise StreamRefused("bad-argv", "argv must name a program", "argv")
        if any("\x00" in a for a in argv):
            raise StreamRefused("bad-argv", "arguments cannot contain NUL bytes", "argv")
        me = pwd.getpwuid(os.geteuid())
        user = _account(spec.user or ctx.default_user)
        switch = user.pw_uid != me.pw_uid
        if switch and os.geteuid() != 0:
            raise StreamRefused(
                "bad-user",
                f"cannot run as {user.pw_name!r}: the agent does not run as root",
                "user",
            )
        cwd = spec.cwd or (user.pw_dir if os.path.isdir(user.pw_dir) else "/")
        if not os.path.isabs(cwd) or not os.path.isdir(cwd):
            raise StreamRefused("bad-cwd", f"working directory {cwd!r} does not exist", "cwd")
        env = _base_env(user)
        env.update(ctx.base_env)
        if ctx.egress_listen and agent_egress.TOKEN.fullmatch(spec.egress_token):
            # the run's own proxy URL: its connections are counted to it (its egress bytes)
            env.update(agent_egress.proxy_env(ctx.egress_listen, spec.egress_token))
        env.update(spec.env)
        try:
            cg = ctx.cgroups.create(f"exec-{stream.id}", spec.budget, spare=True)
        except BudgetRefused as exc:
            raise StreamRefused("budget-unsupported", exc.message, exc.field) from None
        groups = os.getgrouplist(user.pw_name, user.pw_gid) if switch else []
        try:
            if cg is not None:
                problem = program_problem(argv[0], env, cwd, user)
                if problem:
                    raise StreamRefused("bad-argv", problem, "argv")
            proc = _spawn(
                argv,
                stdin=spec.stdin,
                cwd=cwd,
                env=env,
                user=user if switch else None,
                groups=groups,
                cg=cg,
            )
        except StreamRefused:
            if cg is not None:
                cg.remove()
            raise
        except OSError as exc:
            if cg is not None:
                cg.remove()
            if exc.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR):
                raise StreamRefused(
                    "bad-argv", f"cannot run {argv[0]!r}: {exc.strerror}", "argv"
                ) from None
            raise StreamRefused("internal", f"cannot start {argv[0]!r}: {exc}") from None
        except (subprocess.SubprocessError, ValueError) as exc:  # ValueError: a NUL in the env
            if cg is not None:
                cg.remove()
            raise StreamRefused("internal", f"cannot start {argv[0]!r}: {exc}") from None
        run = cls(stream, spec, proc, cg, ctx.cgroups)
        log.info(
            "exec %d started (pid %d, %s)",
            stream.id,
            run.pid,
            run.enforcement,
            extra={"stream_id": stream.id, "pid": run.pid},
        )
        return run, pb.StreamAccept(exec=pb.ExecStarted(pid=run.pid, enforcement=run.enforcement))

    # ---- output ------------------------------------------------------------------------------
    def _flow(self, ch: int) -> None:
        """Read `ch` only while the stream has credit for it."""
        fd = self._outputs.get(ch)
        if fd is None:
            return
        want = self._discard or self.stream.room(ch) > 0
        if want and ch not in self._reading:
            self._loop.add_reader(fd, self._on_readable, ch)
            self._reading.add(ch)
        elif not want and ch in self._reading:
            self._loop.remove_reader(fd)
            self._reading.discard(ch)

    def _on_readable(self, ch: int) -> None:
        fd = self._outputs.get(ch)
        if fd is None:
            return
        room = CHUNK if self._discard else min(CHUNK, self.stream.room(ch))
        if room <= 0:
            self._close_output(ch)
            return
        data, eof = _read_some(fd, room)
        if not data and not eof:
            return
        self.written[ch] += len(data)
        if self._discard:
            if eof:
                self._close_output(ch)
            return
        over = over_output(self.budget.output_bytes, self.written[STDOUT] + self.written[STDERR])
        if over > 0:
            if len(data) > over:
                self.stream.send(ch, data[: len(data) - over])
            self._end("output-limit")
            if eof:
                self._close_output(ch)
            return
        if eof:  # the last of the output and its end in one frame (a short command's answer)
            if data:
                self.stream.send(ch, data, eof=True)
            self._close_output(ch, eof_sent=bool(data))
            return
        self.stream.send(ch, data)
        self._flow(ch)

    def _close_output(self, ch: int, eof_sent: bool = False) -> None:
        fd = self._outputs.pop(ch, None)
        if fd is None:
            return
        if ch in self._reading:
            self._loop.remove_reader(fd)
            self._reading.discard(ch)
        self._close_fd(fd)
        if not eof_sent:
            self.stream.send(ch, b"", eof=True)
        self._maybe_finish()

    def _close_fd(self, fd: int) -> None:
        pipe = self._files.pop(fd, None)
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()

    def on_credit(self, channel: int) -> None:
        self._flow(channel)

    # ---- stdin -------------------------------------------------------------------------------
    def on_data(self, channel: int, data: bytes, eof: bool) -> None:
        if channel != STDIN:
            self.stream.consumed(channel, len(data))
            return
        if self._stdin_fd is None or self._stdin_broken:
            self.stream.consumed(STDIN, len(data))
        else:
            self._stdin += data
            self._write_stdin()
        if eof:
            self._stdin_eof = True
            self._write_stdin()

    def _write_stdin(self) -> None:
        fd = self._stdin_fd
        if fd is None:
            return
        while self._stdin:
            try:
                n = os.write(fd, self._stdin[:CHUNK])
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the command closed its stdin; the rest is dropped
                self.stream.consumed(STDIN, len(self._stdin))
                self._stdin.clear()
                self._stdin_broken = True
                break
            del self._stdin[:n]
            self.stream.consumed(STDIN, n)
        if self._stdin and not self._writing:
            self._loop.add_writer(fd, self._write_stdin)
            self._writing = True
        elif not self._stdin and self._writing:
            self._loop.remove_writer(fd)
            self._writing = False
        if not self._stdin and (self._stdin_eof or self._stdin_broken):
            self._close_stdin()

    def _close_stdin(self) -> None:
        fd, self._stdin_fd = self._stdin_fd, None
        if fd is None:
            return
        if self._writing:
            self._loop.remove_writer(fd)
            self._writing = False
        self._close_fd(fd)

    # ---- the end -----------------------------------------------------------------------------
    def on_close(self, error: pb.StreamError | None) -> None:
        """The server cancelled, or the link was lost."""
        if error is not None and error.code == "link-lost":
            self._detached = True
        self._end("canceled")

    def _end(self, reason: str) -> None:
        """A budget (or a cancel) ends the run: kill all of it."""
        if self.ended:
            return
        if not self.reason:
            self.reason = reason
            log.info(
                "exec %d ends: %s", self.stream.id, reason, extra={"stream_id": self.stream.id}
            )
        self._kill_all()
        if reason in ("output-limit", "canceled") and not self._discard:
            self._discard = True  # drain the pipes to their end, sending nothing more
            for ch in list(self._outputs):
                self._flow(ch)
        if self._detached:
            for ch in list(self._outputs):
                self._drop_output(ch)

    def _kill_all(self) -> None:
        kill_run(self.cgroup, self.pid)

    def _drop_output(self, ch: int) -> None:
        fd = self._outputs.pop(ch, None)
        if fd is not None:
            if ch in self._reading:
                self._loop.remove_reader(fd)
                self._reading.discard(ch)
            self._close_fd(fd)
        self._maybe_finish()

    def _reap(self) -> bool:
        try:
            pid, status, rusage = os.wait4(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.status = -1
            return True
        if pid == 0:
            return False
        self.status = status
        self.rusage = rusage
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return True

    def _on_exit(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._reap():
            self._after_exit()
        else:
            self._timers.append(self._loop.call_later(0.01, self._poll_exit))

    def _poll_exit(self) -> None:
        if self.status is None and self._reap():
            self._after_exit()
        elif self.status is None:
            self._timers.append(self._loop.call_later(0.05, self._poll_exit))

    def _after_exit(self) -> None:
        self._duration = time.monotonic() - self._started
        # The run is over when its command is: nothing it left behind outlives it.
        self._kill_all()
        self._close_stdin()
        if self.cgroup is None and self._outputs:
            self._timers.append(self._loop.call_later(NO_CGROUP_GRACE, self._give_up_outputs))
        self._maybe_finish()

    def _give_up_outputs(self) -> None:
        for ch in list(self._outputs):
            self._drop_output(ch)

    def _maybe_finish(self) -> None:
        if self.ended or self.status is None or self._outputs:
            return
        self.ended = True
        for t in self._timers:
            t.cancel()
        usage = self.cgroup.usage() if self.cgroup is not None else Usage()
        if not self.reason and self.cgroup is not None:
            self.reason = self.cgroup.exceeded(usage)
        result = self._result(usage)
        if not self._detached:
            self.stream.finish(pb.StreamClose(exec=result))
        if self.cgroup is not None:
            # after the answer has gone (the link's sender runs first): nothing waits on it
            self._loop.call_soon(self.cgroup.remove, self._loop)
            if self._cgroups is not None:
                self._loop.call_soon(self._cgroups.refill)
        log.info(
            "exec %d finished: %s",
            self.stream.id,
            result.signal or result.code,
            extra={"stream_id": self.stream.id, "reason": self.reason},
        )

    def _result(self, usage: Usage) -> pb.ExecResult:
        status = self.status if self.status is not None else -1
        res = pb.ExecResult(
            reason=self.reason,
            duration_us=int(self._duration * 1_000_000),
            stdout_bytes=self.written[STDOUT],
            stderr_bytes=self.written[STDERR],
            enforcement=self.enforcement,
        )
        if status >= 0:
            code = os.waitstatus_to_exitcode(status)
            if code < 0:
                res.signal = _signal_name(-code)
            else:
                res.has_code = True
                res.code = code
        res.cpu_us, res.peak_memory_bytes = measured(usage, self.rusage)
        return res
