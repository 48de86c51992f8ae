"""One PTY session in the agent: the process, its output ring and flow control.

Start: no Python runs in the child. The agent opens the PTY, sets its size, and starts the
command with `Popen` (vfork and exec, or a plain fork and exec to switch users — not the Python
fork of `ptyprocess`, whose child runs the interpreter until exec: ~10 ms of a session's open
on a host) through util-linux's `setsid --ctty`, which makes the process a new session whose
controlling terminal is the PTY, as `login_tty` would. The agent does not wait for that (an
exec in a TCG guest is tens of ms of its loop): until the group exists a signal goes to the
process itself (through its pidfd), and the PTY's foreground group is never taken while it is
still unset. The terminal's signals (INT, QUIT, TSTP, TTIN, TTOU, HUP) start at their default
actions even when the agent was started with them ignored (a background job, `nohup`). With
a budget, `/bin/sh` holds the start on a pipe until the agent has put the pid in the run's
cgroup, as an exec's held start does. What `execve` would refuse is refused before the spawn
(`programs.py`). `ptyprocess` keeps the PTY's bookkeeping (size, the master's file object).

Output: the PTY is read (non-blocking, from the event loop) into the session's ring. Reading
stops while the unsent backlog reaches the send window or the unacknowledged bytes reach half
the ring — the process then blocks on its own writes, exactly as on a slow terminal — and
resumes when the link drains or the server acknowledges. So the agent reads a
PTY only as fast as the link drains and never loses a byte the server has not acknowledged.

Exit: a pidfd says when the process ended; the session finishes once its output is drained
(EOF on the PTY, or a short grace time when a leftover background process holds the PTY).

Budget: a session opened with one (`OpenSession.budget`, a task run's or an admin's) runs in
a cgroup of its own, joined before the command runs, with the exec's limits and the same kernel
notifications (`cgroups.py`); its wall-clock timeout is a timer and its output bytes are
counted as the PTY is read. An exceeded budget kills all of the session (reason `timeout`,
`memory`, `pids`, `output-limit` in its exit), and whatever the session leaves behind ends
with it (its cgroup is removed). The exit also says what the session used: CPU time, peak
memory (the cgroup's; without one, the exit status's rusage) and output bytes. A session
without a budget runs where sessions always ran (the agent's own leaf cgroup), and processes it
leaves behind live on.

Sending: the session owns its flow state — what was sent on the current link (`sent`), what
the server holds (`acked`) — and says what goes next (`next_message`): a small read (an echo) at
once, a flood in messages of up to 64 KiB, waiting at most 2 ms to fill one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import pwd
import shutil
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptyprocess import PtyProcess

from agentic_sandbox.agent import files
from agentic_sandbox.agent.cgroups import (
    BudgetRefused,
    Cgroups,
    RunCgroup,
    Usage,
    kill_run,
    measured,
    over_output,
)
from agentic_sandbox.agent.keeper import Adopted, KeeperLink
from agentic_sandbox.agent.programs import (
    HOLD_THEN_PTY,
    SH,
    program_problem,
    unignore_terminal_signals,
)
from agentic_sandbox.agent.ring import Ring
from agentic_sandbox.proto import agent_pb2 as pb

log = logging.getLogger(__name__)

BATCH_BYTES = 64 * 1024  # at most this much output per message
BATCH_WAIT = 0.002  # a flooding session waits at most this long to fill a message
READ_BYTES = 64 * 1024  # one read; a burst reads up to BURST_BYTES per loop callback
BURST_BYTES = 256 * 1024
SEND_WINDOW = 256 * 1024  # unsent bytes before the PTY is no longer read
INPUT_LIMIT = 1024 * 1024
DRAIN_AFTER_EXIT = 0.5
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SIGNALS = {
    "INT": signal.SIGINT,
    "TERM": signal.SIGTERM,
    "KILL": signal.SIGKILL,
    "HUP": signal.SIGHUP,
}


class SpawnError(Exception):
    pass


@dataclass
class ExitResult:
    code: int | None = None
    signal: str = ""
    error: str = ""
    reason: str = ""  # the budget it exceeded: timeout, memory, pids, output-limit
    cpu_us: int = 0
    peak_memory_bytes: int = 0
    output_bytes: int = 0
    enforcement: str = "none"


def _user_env(user: pwd.struct_passwd) -> dict[str, str]:
    env = {
        "HOME": user.pw_dir,
        "USER": user.pw_name,
        "LOGNAME": user.pw_name,
        "SHELL": user.pw_shell or "/bin/sh",
        "PATH": DEFAULT_PATH,
        "TERM": "xterm-256color",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    return env


def _limited(budget: pb.Budget | None) -> bool:
    return budget is not None and any(
        (
            budget.timeout_ms,
            budget.memory_bytes,
            budget.cpu_millis,
            budget.pids,
            budget.output_bytes,
        )
    )


def _setsid() -> str:
    """util-linux's `setsid` (Essential in Debian: in every image and on every host we run on)."""
    found = shutil.which("setsid", path=DEFAULT_PATH)
    if found is None:
        raise SpawnError("cannot start a session: util-linux's setsid is not installed")
    return found


def _spawn_pty(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    rows: int,
    cols: int,
    user: pwd.struct_passwd | None,
    groups: list[int],
    cg: RunCgroup | None,
) -> tuple[int, int]:
    """Start `argv` on a new PTY, the PTY its controlling terminal, as `user` (None: the
    agent's own), in `cg` before it runs: (pid, the master's descriptor). No Python runs in
    the child (see the module's doc)."""
    setsid = _setsid()
    master, slave = os.openpty()
    hold_r = hold_w = -1
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        cmd, stdin = [setsid, "--ctty", "--", *argv], slave
        if cg is not None:  # held in /bin/sh on a pipe until the pid is in the cgroup
            hold_r, hold_w = os.pipe()
            cmd, stdin = [SH, "-c", HOLD_THEN_PTY, setsid, "--ctty", "--", *argv], hold_r
        unignore_terminal_signals()
        child = subprocess.Popen(
            cmd,
            stdin=stdin,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            user=user.pw_uid if user is not None else None,
            group=user.pw_gid if user is not None else None,
            extra_groups=groups if user is not None else None,
        )
        # the session reaps it (a pidfd, then wait4 for its rusage): `Popen` must never wait
        # for it, nor reap it when this object is collected
        child.returncode = 0
    except BaseException as exc:
        for fd in (master, hold_w):
            if fd >= 0:
                os.close(fd)
        if isinstance(exc, OSError):
            raise SpawnError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        if isinstance(exc, ValueError | subprocess.SubprocessError):  # e.g. a NUL in the env
            raise SpawnError(f"cannot start {argv[0]!r}: {exc}") from None
        raise
    finally:
        os.close(slave)
        if hold_r >= 0:
            os.close(hold_r)
    if cg is None:
        return child.pid, master
    try:
        cg.join(child.pid)
        os.write(hold_w, b"\n")
    except OSError as exc:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)  # still held: nothing of the command ran
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child.pid, 0)
        os.close(master)
        raise SpawnError(f"cannot put the session in its cgroup: {exc}") from None
    finally:
        os.close(hold_w)
    return child.pid, master


class PtySession:
    def __init__(
        self,
        session_id: str,
        proc: PtyProcess,
        *,
        ring_bytes: int,
        cols: int,
        rows: int,
        task_id: str,
        on_output: Callable[[], None],
        on_finish: Callable[[], None],
        budget: pb.Budget | None = None,
        cgroup: RunCgroup | None = None,
        ring: Ring | None = None,
        keeper: KeeperLink | None = None,
        adopted: bool = False,
    ) -> None:
        self.id = session_id
        self.proc = proc
        self.fd: int = proc.fd
        self.pid: int = proc.pid
        self.ring = ring if ring is not None else Ring(ring_bytes)
        self.keeper = keeper  # holds the PTY and the ring while workers come and go
        self.adopted = adopted  # taken on from a previous worker: the keeper reaps it
        self.cols = cols
        self.rows = rows
        self.task_id = task_id
        self.sent = 0  # next offset to send on the current link
        self.acked = 0  # the server holds everything below
        self.first_pending: float | None = None  # loop time the oldest unsent byte arrived
        self.flooding = False  # the last read burst filled a whole read: batch output
        self.eof = False
        self.exit: ExitResult | None = None
        self.finished = False  # exited and drained: only the exit report is left
        self.exit_sent = False
        self.forget = False
        # `OpenSession.list_on_exit`, listed once into the exit (not kept by the keeper: a
        # session adopted after a restart exits without it, and the server lists by stream)
        self.list_on_exit = ""
        self._exit_listing: pb.FileListing | None = None
        self._listed = False
        self._on_output = on_output
        self._on_finish = on_finish
        self._reading = False
        self._input = bytearray()
        self._writing = False
        self._pidfd: int | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._kill_timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self.budget = budget if budget is not None else pb.Budget()
        self.cgroup = cgroup
        self.enforcement = cgroup.enforcement if cgroup is not None else "none"
        self.reason = ""  # the budget that ended it
        self.rusage: object | None = None
        self._budget_timer: asyncio.TimerHandle | None = None

    # ---- creation ----------------------------------------------------------------------------
    @classmethod
    def spawn(
        cls,
        session_id: str,
        *,
        command: list[str],
        cols: int,
        rows: int,
        env: dict[str, str],
        cwd: str,
        user: str,
        ring_bytes: int,
        task_id: str,
        on_output: Callable[[], None],
        on_finish: Callable[[], None],
        budget: pb.Budget | None = None,
        cgroups: Cgroups | None = None,
        keeper: KeeperLink | None = None,
    ) -> PtySession:
        me = pwd.getpwuid(os.geteuid())
        switch: pwd.struct_passwd | None = None
        if user and user != me.pw_name:
            try:
                target = pwd.getpwnam(user)
            except KeyError:
                raise SpawnError(f"no such user {user!r}") from None
            if os.geteuid() != 0:
                raise SpawnError(f"cannot run as {user!r}: the agent does not run as root")
            switch = target
        else:
            target = me
        full_env = _user_env(target)
        full_env.update(env)
        argv = list(command) or [target.pw_shell or "/bin/sh", "-l"]
        workdir = cwd or (target.pw_dir if os.path.isdir(target.pw_dir) else "/")
        if not os.path.isdir(workdir):
            raise SpawnError(f"working directory {workdir!r} does not exist")
        cg: RunCgroup | None = None
        if _limited(budget) and cgroups is not None:
            assert budget is not None
            try:
                cg = cgroups.create(f"session-{session_id}", budget)
            except BudgetRefused as exc:
                raise SpawnError(f"{exc.field}: {exc.message}") from None
        groups = os.getgrouplist(switch.pw_name, switch.pw_gid) if switch is not None else []
        try:
            problem = program_problem(argv[0], full_env, workdir, target)
            if problem:
                raise SpawnError(problem)
            pid, master = _spawn_pty(
                argv,
                cwd=workdir,
                env=full_env,
                rows=rows,
                cols=cols,
                user=switch,
                groups=groups,
                cg=cg,
            )
        except BaseException:
            if cg is not None:
                cg.remove()
            raise
        proc = PtyProcess(pid, master)
        kept = keeper is not None and keeper.alive
        sess = cls(
            session_id,
            proc,
            ring_bytes=ring_bytes,
            cols=cols,
            rows=rows,
            task_id=task_id,
            on_output=on_output,
            on_finish=on_finish,
            budget=budget,
            cgroup=cg,
            ring=Ring.shared(ring_bytes, session_id) if kept else None,
            keeper=keeper if kept else None,
        )
        sess._start()
        sess._hand_to_keeper()
        return sess

    def _hand_to_keeper(self) -> None:
        """Give the keeper copies of the PTY and the ring, and what a new worker needs to take
        the session on (`keeper.py`)."""
        if self.keeper is None or self.ring.fd is None:
            return
        deadline = 0.0
        if self.budget.timeout_ms:
            deadline = time.time() + self.budget.timeout_ms / 1000.0
        meta = {
            "task_id": self.task_id,
            "budget": self.budget.SerializeToString().hex(),
            "deadline": deadline,
            "cgroup": (
                {
                    "version": self.cgroup.version,
                    "dirs": {k: str(v) for k, v in self.cgroup.dirs.items()},
                }
                if self.cgroup is not None
                else None
            ),
        }
        self.keeper.hold(self.id, self.pid, [self.fd, self.ring.fd], meta)

    @classmethod
    def adopt(
        cls,
        held: Adopted,
        *,
        on_output: Callable[[], None],
        on_finish: Callable[[], None],
        keeper: KeeperLink,
    ) -> PtySession:
        """Take on a session a previous worker left with the keeper: its PTY, its ring (every
        byte read so far), its budget (the rest of its timeout) and its cgroup."""
        ring = Ring.attach(held.ring_fd)
        meta = held.meta
        budget = pb.Budget()
        with contextlib.suppress(ValueError, TypeError):
            budget.ParseFromString(bytes.fromhex(str(meta.get("budget", ""))))
        cg_meta = meta.get("cgroup")
        cg = None
        if isinstance(cg_meta, dict):
            cg = RunCgroup(
                int(cg_meta["version"]), {k: Path(v) for k, v in cg_meta["dirs"].items()}, budget
            )
        proc = PtyProcess(held.pid, held.master_fd)
        rows, cols = 24, 80
        with contextlib.suppress(OSError):
            rows, cols = proc.getwinsize()
        sess = cls(
            held.sid,
            proc,
            ring_bytes=ring.capacity,
            cols=cols,
            rows=rows,
            task_id=str(meta.get("task_id", "")),
            on_output=on_output,
            on_finish=on_finish,
            budget=budget,
            cgroup=cg,
            ring=ring,
            keeper=keeper,
            adopted=True,
        )
        sess.acked = ring.start
        sess.sent = ring.start
        deadline = float(meta.get("deadline") or 0)
        sess._start(timeout=max(0.0, deadline - time.time()) if deadline else None)
        if held.exit is not None:
            sess.exited(held.exit)
        return sess

    def exited(self, status: dict[str, Any]) -> None:
        """An adopted session's exit, as the keeper (its parent now) reaped it."""
        if self.exit is not None:
            return
        code = status.get("code")
        self.exit = ExitResult(
            code=int(code) if isinstance(code, int) else None, signal=str(status.get("signal", ""))
        )
        self.rusage = None
        self._after_exit()

    def _start(self, *, timeout: float | None = None) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        if self.adopted:
            pass  # the keeper is its parent: its exit arrives through `exited`
        else:
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except (AttributeError, OSError):
                self._pidfd = None
                self._loop.call_later(0.1, self._poll_exit)
            else:
                self._loop.add_reader(self._pidfd, self._on_pidfd)
        if timeout is None and self.budget.timeout_ms:
            timeout = self.budget.timeout_ms / 1000.0
        if timeout is not None and self.budget.timeout_ms:
            self._budget_timer = self._loop.call_later(timeout, self.exceeded, "timeout")
        if self.cgroup is not None:
            self.cgroup.watch(self._loop, self.exceeded)
        self.update_flow()

    # ---- output ------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return self.ring.end - self.sent

    def next_message(self, now: float) -> tuple[pb.AgentMessage | None, float | None]:
        """The next message of this session for the link (output, then its exit once all
        output is sent), or (None, seconds to wait for a batch to fill), or (None, None)."""
        pending = self.pending
        if pending > 0:
            if (
                pending < BATCH_BYTES
                and self.flooding
                and not self.finished
                and self.first_pending is not None
            ):
                left = self.first_pending + BATCH_WAIT - now
                if left > 0:
                    return None, left
            data = self.ring.read(self.sent, BATCH_BYTES)
            msg = pb.AgentMessage(
                output=pb.SessionOutput(session_id=self.id, offset=self.sent, data=data)
            )
            self.sent += len(data)
            self.first_pending = now if self.pending else None
            self.update_flow()
            return msg, None
        if self.finished and not self.exit_sent and self.exit is not None:
            self.exit_sent = True
            if self.list_on_exit and not self._listed:
                self._listed = True
                self._exit_listing = files.exit_listing(self.list_on_exit)
            ended = pb.SessionExit(
                session_id=self.id, end_offset=self.ring.end, exit=self.exit_info()
            )
            if self._exit_listing is not None:
                ended.listing.CopyFrom(self._exit_listing)
            return pb.AgentMessage(exit=ended), None
        return None, None

    def ack(self, offset: int) -> None:
        """The server holds everything below `offset`."""
        if offset > self.acked:
            self.acked = min(offset, self.ring.end)
            self.update_flow()

    def resume_from(self, offset: int) -> int:
        """A new link: send again from `offset` (what the server asked for, within what the
        ring still holds); returns where sending resumes."""
        frm = max(self.ring.start, min(offset, self.ring.end))
        self.sent = frm
        self.acked = max(self.acked, frm)
        self.exit_sent = False
        self.first_pending = None
        self.update_flow()
        return frm

    def resend_all(self) -> None:
        """A new link that did not mention this session: send everything still held."""
        self.sent = self.ring.start
        self.exit_sent = False

    def exit_info(self) -> pb.ExitInfo | None:
        if self.exit is None:
            return None
        e = self.exit
        return pb.ExitInfo(
            has_code=e.code is not None,
            code=e.code or 0,
            signal=e.signal,
            error=e.error,
            reason=e.reason,
            cpu_us=e.cpu_us,
            peak_memory_bytes=e.peak_memory_bytes,
            output_bytes=e.output_bytes,
            enforcement=e.enforcement,
        )

    def inventory(self) -> pb.SessionInventory:
        return pb.SessionInventory(
            session_id=self.id,
            state=pb.SESSION_STATE_EXITED if self.finished else pb.SESSION_STATE_RUNNING,
            ring_start=self.ring.start,
            end_offset=self.ring.end,
            exit=self.exit_info() if self.finished else None,
            cols=self.cols,
            rows=self.rows,
            pid=self.pid,
            task_id=self.task_id,
        )

    def unacked_room(self) -> int:
        """How much more may be read: unacknowledged output stays within half the ring, so the
        ring always still holds at least half a ring of acknowledged history — what a client
        reattaching after a server restart may not have received yet."""
        return self.ring.capacity // 2 - (self.ring.end - self.acked)

    def update_flow(self) -> None:
        """Read the PTY only while the backlog fits (see the module note)."""
        if self.eof or self.finished:
            return
        room = self.unacked_room()
        want = room > 0 and self.pending < SEND_WINDOW
        if want and not self._reading:
            self._loop.add_reader(self.fd, self._on_readable)
            self._reading = True
        elif not want and self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False

    def _on_readable(self) -> None:
        ring = self.ring
        fd = self.fd
        total = 0
        had_pending = self.pending > 0
        full = False
        while total < BURST_BYTES:
            room = self.unacked_room()
            if room <= 0 or self.pending >= SEND_WINDOW:
                break
            draining = self.reason == "output-limit"  # being killed: drain, keep nothing
            try:
                if draining:
                    n = len(os.read(fd, READ_BYTES))
                else:
                    n = ring.read_from(fd, min(READ_BYTES, room))
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.EIO:
                    log.warning("session %s: reading the PTY failed: %s", self.id, exc)
                self._on_eof()
                break
            if not n:
                self._on_eof()
                break
            if draining:
                total += n
                continue
            over = over_output(self.budget.output_bytes, ring.end)
            if over:
                ring.drop_tail(over)
                total += n - min(over, n)
                self.exceeded("output-limit")
                continue
            total += n
            if n < 1024:
                break  # a small read: the PTY is drained (interactive output)
            full = True
        if total:
            self.flooding = full
            if not had_pending:
                self.first_pending = self._loop.time()
            self._on_output()
        self.update_flow()

    def _on_eof(self) -> None:
        self.eof = True
        if self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False
        if self.exit is not None:
            self._finish()

    def exceeded(self, reason: str) -> None:
        """A budget ends the session: kill all of it (the first reason is the one reported)."""
        if self.reason or self.exit is not None:
            return
        self.reason = reason
        log.info("session %s ends: %s", self.id, reason, extra={"session_id": self.id})
        kill_run(self.cgroup, self.pid)

    # ---- input and control ----------------------------------------------------------------------
    def write_input(self, data: bytes) -> None:
        if self.finished or self.eof:
            return
        if self._input:
            if len(self._input) + len(data) > INPUT_LIMIT:
                log.warning("session %s: input backlog full; %d bytes dropped", self.id, len(data))
                return
            self._input += data
            return
        try:
            n = os.write(self.fd, data)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            log.debug("session %s: writing input failed: %s", self.id, exc)
            return
        if n < len(data):
            self._input += data[n:]
            self._loop.add_writer(self.fd, self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        try:
            n = os.write(self.fd, self._input)
        except BlockingIOError:
            return
        except OSError:
            n = len(self._input)
        del self._input[:n]
        if not self._input and self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False

    def resize(self, cols: int, rows: int) -> None:
        if self.finished or cols < 1 or rows < 1:
            return
        self.cols, self.rows = cols, rows
        with contextlib.suppress(OSError):
            self.proc.setwinsize(rows, cols)

    def _process_groups(self, name: str) -> set[int]:
        groups: set[int] = set()
        with contextlib.suppress(OSError):
            groups.add(os.tcgetpgrp(self.fd))
        # never 0 (a PTY without a foreground group yet: killpg(0) is the agent's own group)
        # nor the agent's group
        groups.discard(0)
        groups.discard(os.getpgrp())
        if name != "INT" or not groups:
            groups.add(self.pid)  # the session leader's group
        return groups

    def send_signal(self, name: str) -> None:
        sig = SIGNALS.get(name)
        if sig is None or self.exit is not None:
            return
        for pgid in self._process_groups(name):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                if pgid == self.pid:
                    self._signal_leader(sig)
            except PermissionError:
                pass

    def _signal_leader(self, sig: int) -> None:
        """The process itself, before it has made its own group (`setsid --ctty` runs in the
        child a moment after the spawn returns): through its pidfd, which names this process
        and no other — never a pid the kernel may have given to another since."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def close(self, grace: float) -> None:
        """End the session: HUP now, KILL after `grace` seconds if it is still there."""
        if self.exit is not None:
            return
        self.send_signal("HUP")
        if self._kill_timer is None:
            self._kill_timer = self._loop.call_later(max(0.0, grace), self.send_signal, "KILL")

    # ---- exit ------------------------------------------------------------------------------------
    def _reap(self) -> bool:
        try:
            pid, status, self.rusage = os.wait4(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.exit = ExitResult(error="the process vanished")
            return True
        if pid == 0:
            return False
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            try:
                name = signal.Signals(-code).name.removeprefix("SIG")
            except ValueError:
                name = str(-code)
            self.exit = ExitResult(code=None, signal=name)
        else:
            self.exit = ExitResult(code=code)
        return True

    def _on_pidfd(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if not self._reap():
            self._loop.call_later(0.05, self._poll_exit)
            return
        self._after_exit()

    def _poll_exit(self) -> None:
        if self.exit is not None:
            return
        if self._reap():
            self._after_exit()
        else:
            self._loop.call_later(0.1, self._poll_exit)

    def _after_exit(self) -> None:
        if self._kill_timer is not None:
            self._kill_timer.cancel()
            self._kill_timer = None
        if self._budget_timer is not None:
            self._budget_timer.cancel()
            self._budget_timer = None
        if self.cgroup is not None:
            kill_run(self.cgroup, self.pid)  # a budgeted run is over when its command is
        if self.eof:
            self._finish()
        else:
            # Drain what is left; a background process may hold the PTY open, so not forever.
            self._drain_timer = self._loop.call_later(DRAIN_AFTER_EXIT, self._finish)

    def _finish(self) -> None:
        if self.finished:
            return
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        if not self.eof:
            # read what is there now, then hang up on whoever still holds the PTY
            with contextlib.suppress(OSError):
                while True:
                    data = os.read(self.fd, READ_BYTES)
                    if not data:
                        break
                    room = self.unacked_room()
                    if len(data) > room:
                        break
                    self.ring.append(data)
            self.eof = True
        self._account()
        self.finished = True
        self._release()
        self._on_output()
        self._on_finish()

    def _account(self) -> None:
        """What the session used (and the budget the kernel enforced), into its exit."""
        cg, e = self.cgroup, self.exit
        usage = cg.usage() if cg is not None else Usage()
        if not self.reason and cg is not None:
            self.reason = cg.exceeded()
        if cg is not None:
            self.cgroup = None
            cg.remove(self._loop)
        if e is not None:
            e.reason = self.reason
            e.cpu_us, e.peak_memory_bytes = measured(usage, self.rusage)
            e.output_bytes = self.ring.end
            e.enforcement = self.enforcement

    def _release(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False
        if self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        # We reaped the child ourselves; keep ptyprocess from waiting for it again.
        self.proc.terminated = True
        self.proc.closed = True
        with contextlib.suppress(OSError):
            self.proc.fileobj.close()

    def hand_over(self) -> None:
        """The worker exits for a planned restart: leave the process and the PTY to the keeper
        (ptyprocess would otherwise hang up on the child when its object is collected)."""
        self.proc.closed = True
        self.proc.terminated = True

    def shutdown(self) -> None:
        """The agent is exiting, or the server forgot the session: hang up on the process and
        release the PTY (and the keeper's copies)."""
        if self.keeper is not None:
            self.keeper.release(self.id)
        self.ring.close()
        if not self.finished:
            self.send_signal("HUP")
            self.finished = True
            self._release()
        if self._budget_timer is not None:
            self._budget_timer.cancel()
            self._budget_timer = None
        if self.cgroup is not None:
            cg, self.cgroup = self.cgroup, None
            cg.remove()
